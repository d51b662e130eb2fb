"""Keras runs on its PyTorch backend in these tests (the backend accumcheck.integrations.keras checks);
the backend is chosen before keras is first imported. Where Keras 3 or torch is missing, the tests skip."""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")
