"""Streaming: SSD emits several tokens per round; TextStreamer / TextIteratorStreamer work as usual."""
from threading import Thread

from transformers import TextIteratorStreamer, TextStreamer

from _common import encode, load, parser

args = parser(__doc__).parse_args()
target, draft, tok, n = load(args)
inputs = encode(tok, "Explain what a hash map is in two sentences.")

# 1) print as tokens arrive
target.generate(**inputs, assistant_model=draft, ssd=True, max_new_tokens=n, do_sample=False,
                streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True))

# 2) iterate in another thread (e.g. a web server)
streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
kwargs = dict(**inputs, assistant_model=draft, ssd=True, max_new_tokens=n, do_sample=False, streamer=streamer)
thread = Thread(target=target.generate, kwargs=kwargs)
thread.start()
pieces = [text for text in streamer]
thread.join()
full = target.generate(**inputs, max_new_tokens=n, do_sample=False)
expected = tok.decode(full[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)
print(f"\nstreamed {len(pieces)} pieces; same text as plain generation: {''.join(pieces) == expected}")
assert "".join(pieces) == expected
