"""hf_ssd: exact Speculative Speculative Decoding (Saguaro) for transformers.

Importing hf_ssd enables `model.generate(..., assistant_model=draft, ssd=True)` for every transformers model;
`hf_ssd.disable()` restores the stock generate(), `hf_ssd.enable(model)` enables one model only.
"""
from hf_ssd.config import SSDConfig
from hf_ssd.hf.generate import SSDGenerateOutput, disable, enable, is_enabled, last_stats
from hf_ssd.warmup import warmup
from hf_ssd.workers.process import DraftProcess

__all__ = ["DraftProcess", "SSDConfig", "SSDGenerateOutput", "enable", "disable", "is_enabled", "last_stats", "warmup"]
__version__ = "0.1.0"

enable()
