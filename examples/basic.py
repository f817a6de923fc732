"""Basic: greedy SSD generation is identical to plain generation, and faster on a real pair."""
from _common import encode, load, parser

args = parser(__doc__).parse_args()
target, draft, tok, n = load(args)
inputs = encode(tok, "Write a Python function that checks whether a number is prime.")

plain = target.generate(**inputs, max_new_tokens=n, do_sample=False)
out = target.generate(**inputs, assistant_model=draft, ssd=True, max_new_tokens=n, do_sample=False,
                      return_dict_in_generate=True)
print(tok.decode(out.sequences[0, inputs.input_ids.shape[1]:], skip_special_tokens=True))
print("identical to plain greedy:", out.sequences.tolist() == plain.tolist())
print({k: out.ssd_stats[k] for k in ("mean_accepted", "hit_rate", "rounds")})
assert out.sequences.tolist() == plain.tolist()
