"""The traffic profile: who sends what (tenants, weights, prompt/output lengths, streaming mix)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROFILE = ROOT / "loadtest" / "profile.yaml"
WORDS = ("river market bridge engineer library lantern harbor orchard painter signal meadow copper "
         "winter garden museum thunder violin canyon pepper silver compass journey ").split()


def sample_length(spec: dict, rng: random.Random) -> int:
    """A length from `{min, max}` (uniform) or `{mean, stddev[, min, max]}` (normal, clipped, as
    genai-perf's synthetic-tokens mean/stddev); at least 1."""
    if "mean" in spec:
        n = round(rng.gauss(spec["mean"], spec.get("stddev", 0)))
        n = max(spec.get("min", 1), min(spec.get("max", n), n))
    else:
        n = rng.randint(spec["min"], spec["max"])
    return max(1, n)


@dataclass
class Profile:
    tenants: list[dict]
    users: dict[str, int]
    prompt_tokens: dict
    output_tokens: dict
    stream_fraction: float

    @classmethod
    def load(cls, path: str | Path = DEFAULT_PROFILE) -> "Profile":
        raw = yaml.safe_load(Path(path).read_text())
        for i, t in enumerate(raw.get("tenants", [])):
            for f in ("name", "api_key"):
                if f not in t:
                    raise ValueError(f"{path}: tenants[{i}].{f} is required")
        return cls(raw.get("tenants", []), raw.get("users", {"grpc_gateway": 1}),
                   raw.get("prompt_tokens", {"min": 16, "max": 64}),
                   raw.get("output_tokens", {"min": 8, "max": 32}), float(raw.get("stream_fraction", 1.0)))

    def pick_tenant(self, rng: random.Random) -> dict:
        return rng.choices(self.tenants, weights=[t.get("weight", 1) for t in self.tenants])[0]

    def prompt(self, rng: random.Random) -> str:
        # ~1 token per word for these common words: close enough to the target length
        n = sample_length(self.prompt_tokens, rng)
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def max_tokens(self, rng: random.Random) -> int:
        return sample_length(self.output_tokens, rng)

    def slos(self) -> dict:
        return {t["name"]: t.get("slo") for t in self.tenants if t.get("slo")}
