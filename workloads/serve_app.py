"""A Ray Serve application around a small torch model.

``serve_config.yaml`` beside this file is a Serve config v2 usable as a
RayService's ``serveConfigV2``; it imports ``workloads.serve_app:app``.
"""
from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from ray import serve  # noqa: E402

FEATURES = 16
CLASSES = 4


@serve.deployment(ray_actor_options={"num_cpus": 0.25})
class Classifier:
    """Scores a feature vector with a fixed-seed MLP and returns the class."""

    def __init__(self, seed: int = 0) -> None:
        import torch

        torch.manual_seed(seed)
        self.torch = torch
        self.model = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
        ).eval()

    async def __call__(self, request) -> dict:
        body = await request.json() if request.method == "POST" else {}
        x = body.get("x") or [0.1] * FEATURES
        if len(x) != FEATURES:
            return {"error": f"expected {FEATURES} features, got {len(x)}"}
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor([x], dtype=self.torch.float32))
        return {"class": int(logits.argmax()), "node": os.environ.get("RAY_NODE_IP_ADDRESS", "")}


app = Classifier.bind()
