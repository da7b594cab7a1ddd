"""Small seeded Keras models for the TensorFlow-family tests, built in the test process (no
downloads): a CNN on NHWC images saved as ``.keras`` and exported as a SavedModel, its NCHW
twin (the layout a torch port takes), and a calibration ``.npz``.

Importing Keras here imports TensorFlow (~5 s, ~700 MB): call ``build`` once per test module.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

SHAPE = (8, 8, 3)  # NHWC, without the batch axis


def images(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, *SHAPE)).astype(np.float32)


def build(folder: Path) -> dict[str, Path]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import keras

    keras.utils.set_random_seed(0)
    image = keras.Input(SHAPE, name="image")
    x = keras.layers.Conv2D(8, 3, padding="same")(image)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(8, 3, strides=2, padding="same", activation="relu")(x)
    x = keras.layers.Flatten()(x)
    logits = keras.layers.Dense(10, name="logits")(x)
    model = keras.Model(image, logits)
    # Non-trivial BatchNorm statistics, so that a port that gets them wrong shows.
    bn = model.layers[2]
    rng = np.random.default_rng(1)
    bn.set_weights([rng.uniform(0.5, 1.5, 8).astype("f"), rng.normal(0, 0.1, 8).astype("f"),
                    rng.normal(0, 0.1, 8).astype("f"), rng.uniform(0.5, 1.5, 8).astype("f")])
    out = {"keras": folder / "cnn.keras", "saved_model": folder / "cnn_saved_model",
           "calibration": folder / "calibration.npz", "nchw_keras": folder / "cnn_nchw.keras"}
    model.save(out["keras"])
    model.export(str(out["saved_model"]), format="tf_saved_model", verbose=False)
    np.savez(out["calibration"], image=images(16, seed=7))
    # The same layers on NCHW input (a Permute in front): what a torch-layout port takes.
    nchw = keras.Input((SHAPE[2], SHAPE[0], SHAPE[1]), name="image")
    twin = keras.Model(nchw, model(keras.layers.Permute((2, 3, 1))(nchw)))
    twin.save(out["nchw_keras"])
    return out
