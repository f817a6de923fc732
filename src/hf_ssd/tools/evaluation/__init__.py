"""`hf-ssd eval`: does SSD keep the outputs of plain decoding? Fidelity (greedy identity, sampling distribution
test), acceptance (mean accepted length, cache hit rate) and HumanEval pass@1, plain vs SSD, with a verdict."""
