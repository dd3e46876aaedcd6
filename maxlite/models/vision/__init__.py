"""Vision encoders: kinds beside the decoder's mixers and feed-forwards. Each has its own params,
logical axes and FLOPs; its tokens enter the decoder where the chat template's image placeholders
stand (maxlite/models/transformer.py)."""
