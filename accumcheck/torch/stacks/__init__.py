"""PyTorch training stacks under accumcheck: Hugging Face ``Trainer`` (``transformers``),
``accelerate`` and Lightning, each a thin adapter over ``recorder`` (the float64 run, the recorded
windows, the capture before clipping), and ``cases`` (a built-in case as a model that computes
its own loss, for ``accumcheck stack``)."""
