"""Sampling (T > 0) with Saguaro: the draft samples from sigma_{F,C} (top-F tokens down-weighted by C) so that the
target's bonus token more often lands on a cached branch. Exact for any C: the output keeps the target's
distribution; C only trades acceptance for cache hits."""
import torch

from _common import encode, load, parser

p = parser(__doc__)
p.add_argument("--temperature", type=float, default=0.7)
args = p.parse_args()
target, draft, tok, n = load(args)
inputs = encode(tok, "Write a haiku about speculative decoding.")

for c in (1.0, 0.5, 0.2):  # C = 1 is plain sampling of the draft
    g = torch.Generator().manual_seed(0)
    # ssd_mode="ssd": compare C on Saguaro itself (left unset, the controller may pick plain decoding or sync SD)
    out = target.generate(**inputs, assistant_model=draft, ssd=True, ssd_mode="ssd", ssd_downweight=c, generator=g,
                          do_sample=True,
                          temperature=args.temperature, top_p=0.95, max_new_tokens=n, return_dict_in_generate=True)
    s = out.ssd_stats
    print(f"C={c}: accepted/round={s['mean_accepted']:.2f} hit_rate={s['hit_rate']:.2f}  "
          f"{tok.decode(out.sequences[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)[:60]!r}")
