"""Serving an lm: the inference engine (paged KV cache, continuous batching, prefix caching) behind `systolic serve`
and `systolic generate`."""
