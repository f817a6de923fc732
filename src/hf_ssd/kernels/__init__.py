"""Compute kernels hf_ssd builds for itself (CPU): each has a pure-torch reference the tests compare it against and
falls back to torch's own operation where it cannot build or does not apply."""
