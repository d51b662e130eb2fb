"""A Keras 3 fit with gradient accumulation, checked step by step: every optimizer step's gradient
against its window's micro-batches as one batch, and its update against the optimizer applied
once (keras#19990: before Keras 3.5, weight decay ran at every micro-batch and Adam's bias
correction counted micro-batches, so the update was not one step of the window's gradient).

    KERAS_BACKEND=torch python examples/keras_accumulation.py [report.json]
        # Keras 3.5 and later: faithful, exit code 0; Keras 3.0-3.4: flagged, exit code 1

A small regression model, AdamW(weight_decay=0.1, gradient_accumulation_steps=4), micro-batches
of 8 samples, two optimizer steps. The report is saved as JSON where a path is given.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import accumcheck.render  # noqa: E402
from accumcheck.integrations.keras import check  # noqa: E402

N = 4


def main(path: str | None = None) -> int:
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(64, 6)).astype("float32")
    y = (x @ np.linspace(-1.0, 1.0, 18).reshape(6, 3)).astype("float32")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dropout(0.1), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-2, weight_decay=0.1, gradient_accumulation_steps=N),
                  loss="mse")
    report = check(model, x, y, batch_size=8, steps=2, shuffle=False)
    print(accumcheck.render.render(report, "table"))
    if path:
        with open(path, "w") as handle:
            handle.write(report.to_json())
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
