"""Saved configs: SSDConfig.save_pretrained / from_pretrained (a directory, a JSON file or a Hub repo id), and a
config stored in a model's generation_config.json (key `ssd_config`) that generate(ssd=True) picks up by itself."""
import tempfile

from transformers import AutoModelForCausalLM

from _common import encode, load, parser
from hf_ssd import SSDConfig
from hf_ssd.hf.hub import attach_to_model

args = parser(__doc__).parse_args()
target, draft, tok, n = load(args)
inputs = encode(tok, "Sum the integers from 1 to 100.")

with tempfile.TemporaryDirectory() as d:
    SSDConfig(mode="sync", num_draft_tokens=3).save_pretrained(d)  # -> d/ssd_config.json
    config = SSDConfig.from_pretrained(d)  # config.push_to_hub("me/my-ssd-config") publishes it
    out = target.generate(**inputs, assistant_model=draft, ssd=True, ssd_config=config, max_new_tokens=n,
                          return_dict_in_generate=True)
    print("explicit config:", out.ssd_stats["mode"], config.num_draft_tokens)

    attach_to_model(SSDConfig(mode="sync", num_draft_tokens=2), draft)  # generation_config.ssd_config
    draft.save_pretrained(f"{d}/draft")
    reloaded = AutoModelForCausalLM.from_pretrained(f"{d}/draft")
    print("stored in the draft's generation_config.json:", SSDConfig.from_pretrained(f"{d}/draft").to_dict()["mode"])
    out = target.generate(**inputs, assistant_model=reloaded, ssd=True, max_new_tokens=n, return_dict_in_generate=True)
    print("picked up by generate(ssd=True):", out.ssd_stats["mode"])
    assert out.ssd_stats["mode"] == "sync"
