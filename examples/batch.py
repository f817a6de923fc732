"""Batch: several prompts of different lengths (left padding) in one SSD generation; each row equals plain greedy."""
from _common import encode, load, parser

args = parser(__doc__).parse_args()
target, draft, tok, n = load(args)
prompts = ["Reverse a string in Python.", "What is 17 * 23?", "Name three sorting algorithms and their complexity."]
inputs = encode(tok, prompts)  # the tokenizer pads on the left

out = target.generate(**inputs, assistant_model=draft, ssd=True, max_new_tokens=n, do_sample=False,
                      return_dict_in_generate=True)
plain = target.generate(**inputs, max_new_tokens=n, do_sample=False)
P = inputs.input_ids.shape[1]
for prompt, row, ref in zip(prompts, out.sequences, plain):
    same = row[P:].tolist()[: len(ref) - P] == ref[P:].tolist()
    print(f"{prompt!r} -> {tok.decode(row[P:], skip_special_tokens=True)[:60]!r}  identical={same}")
    assert same
print("per-row accepted drafts:", out.ssd_stats["per_row"]["accepted"], "hit rate:", out.ssd_stats["hit_rate"])
