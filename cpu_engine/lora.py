"""LoRA adapters for the CPU engine: PEFT folders on disk, an LRU pool in memory, and the per-step view
the model math reads.

An adapter is a folder `<lora_dir>/<name>/` in the PEFT format: `adapter_config.json` (`r`,
`lora_alpha`, `target_modules`, optional `use_rslora`) and `adapter_model.safetensors` with
`base_model.model.model.layers.<i>.<self_attn|mlp>.<module>_proj.lora_{A,B}.weight` ([r, in] and
[out, r]). Its name is the folder's name; on the `tensorrt_llm` contract it travels as
`lora_task_id = task_id(name)` (upstream's uint64 input), which the pool maps back by scanning the folder.

The delta of a module is x·Aᵀ·(scale·B)ᵀ with scale = alpha / r (alpha / sqrt(r) with rsLoRA), added to
the base matmul's output for the rows of that adapter's requests: weights are never merged, so one step
mixes any adapters and the base model. `LoraPool` keeps at most `max_loras` adapters loaded, loads a
missing one on a thread of its own (its requests wait, the engine loop goes on), and evicts the least
recently used adapter that no running request holds.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from contracts.tensors import lora_task_id
from cpu_engine.onnx_graphs import int8_weight_limit
from cpu_engine.quantization import linear_int8, quantize_weight

# module -> (PEFT key part, which dims: (in, out) in terms of the model config)
MODULES = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}
_PEFT_NAMES = {part.split(".")[1]: m for m, part in MODULES.items()}  # "q_proj" -> "q"
_PREFIX = "base_model.model.model.layers."


class AdapterNotFoundError(LookupError):
    """No adapter of that name (or task id) in the adapter directory."""


class AdapterLoadError(ValueError):
    """An adapter that exists but cannot be used (rank above max_lora_rank, shapes that do not fit)."""


# the adapter name -> lora_task_id rule is the tensor contract's (the gateway computes it too)
task_id = lora_task_id


def module_shapes(config) -> dict[str, tuple[int, int]]:
    """module -> (in, out) features for the model config (cpu_engine.checkpoint.LlamaConfig)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)}


@dataclass
class LoraAdapter:
    name: str
    rank: int
    scale: float
    digest: str  # SHA-256 of the folder's two files: the adapter's identity in prefix-cache keys
    # (layer, module) -> (A^T [in, r], (scale * B)^T [r, out]) float32, ready for x @ A^T @ sB^T
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    _a_int8: dict = field(default_factory=dict, repr=False)

    @property
    def identity(self) -> str:
        return f"{self.name}@{self.digest}"

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}

    def a_int8(self, layer: int, module: str) -> tuple[np.ndarray, np.ndarray]:
        """A of a module as int8 [r, in] with one scale per rank row (quantization.quantize_weight, the
        base weights' scheme and limit), for models whose matmuls are int8 (StepLora)."""
        key = (layer, module)
        if key not in self._a_int8:
            self._a_int8[key] = quantize_weight(self.weights[key][0].T, int8_weight_limit())
        return self._a_int8[key]

    def delta_weight(self, layer: int, module: str) -> np.ndarray | None:
        """scale·B·A [out, in]: what merging this adapter adds to the base weight (tests' reference)."""
        pair = self.weights.get((layer, module))
        return None if pair is None else (pair[0] @ pair[1]).T


def load_adapter(folder: str | Path, config, max_rank: int) -> LoraAdapter:
    """Read and check one PEFT adapter folder against the model config; AdapterLoadError says what is wrong."""
    from cpu_engine.checkpoint import _f32, _read_safetensors

    folder = Path(folder)
    name = folder.name
    cfg_path, st_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not cfg_path.is_file() or not st_path.is_file():
        raise AdapterNotFoundError(f"adapter {name!r}: {folder} needs adapter_config.json and adapter_model.safetensors")
    raw_cfg = cfg_path.read_bytes()
    try:
        cfg = json.loads(raw_cfg)
        rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    except (ValueError, KeyError, TypeError) as e:
        raise AdapterLoadError(f"adapter {name!r}: adapter_config.json is not a PEFT LoRA config ({e})") from None
    if rank < 1:
        raise AdapterLoadError(f"adapter {name!r}: rank r={rank} must be >= 1")
    if rank > max_rank:
        raise AdapterLoadError(f"adapter {name!r}: rank {rank} is above max_lora_rank {max_rank}")
    for key, ok in (("fan_in_fan_out", False), ("use_dora", False)):
        if bool(cfg.get(key, False)) != ok:
            raise AdapterLoadError(f"adapter {name!r}: {key}={cfg[key]} is not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterLoadError(f"adapter {name!r}: bias, rank_pattern and alpha_pattern are not supported")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = [t for t in targets if t != "all-linear" and t.split(".")[-1] not in _PEFT_NAMES]
    if unknown:
        raise AdapterLoadError(f"adapter {name!r}: target module(s) {', '.join(unknown)} not among "
                               f"{', '.join(sorted(_PEFT_NAMES))}")
    scale = alpha / (rank ** 0.5 if cfg.get("use_rslora") else rank)
    tensors = _read_safetensors(st_path)
    shapes = module_shapes(config)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        if not key.startswith(_PREFIX) or ".lora_" not in key:
            raise AdapterLoadError(f"adapter {name!r}: unexpected tensor {key}")
        rest = key[len(_PREFIX):].split(".")  # <i>, self_attn|mlp, q_proj, lora_A, [default,] weight
        try:
            layer, module, which = int(rest[0]), _PEFT_NAMES[rest[2]], rest[3]
        except (ValueError, KeyError, IndexError):
            raise AdapterLoadError(f"adapter {name!r}: unexpected tensor {key}") from None
        if not 0 <= layer < config.num_layers:
            raise AdapterLoadError(f"adapter {name!r}: {key}: layer {layer} not in a {config.num_layers}-layer model")
        pairs.setdefault((layer, module), {})[which] = _f32(value)
    if not pairs:
        raise AdapterLoadError(f"adapter {name!r}: no lora_A/lora_B tensors")
    adapter = LoraAdapter(name, rank, scale, hashlib.sha256(raw_cfg + st_path.read_bytes()).hexdigest())
    for (layer, module), ab in sorted(pairs.items()):
        where = f"adapter {name!r}: layer {layer} {MODULES[module]}"
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterLoadError(f"{where}: needs both lora_A and lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        d_in, d_out = shapes[module]
        if a.shape != (rank, d_in) or b.shape != (d_out, rank):
            raise AdapterLoadError(f"{where}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the model "
                                   f"(expected [{rank}, {d_in}] / [{d_out}, {rank}])")
        adapter.weights[(layer, module)] = (np.ascontiguousarray(a.T), np.ascontiguousarray((b * np.float32(scale)).T))
    return adapter


GRAPH_MODULES = {"o": ("o",), "gate": ("gate",), "up": ("up",), "down": ("down",), "qkv": ("q", "k", "v")}


def graph_modules(graph: int, num_layers: int) -> tuple[tuple[str, int], ...]:
    """(graph module, the layer whose adapter weights it takes) of fused graph `graph`, which ends layer
    graph - 1 (o, gate, up, down) and starts layer `graph` (q/k/v)."""
    return tuple((gm, graph - 1) for gm in ("o", "gate", "up", "down") if graph > 0) + \
        ((("qkv", graph),) if graph < num_layers else ())


def module_columns(adapters, module: str) -> list:
    """The low-rank columns a step gives `module`, in order: (adapter, rank) for each of `adapters` that
    targets it, or [(None, 1)], one all-zero column, when none does. The masks and the stacks both
    follow it, so a row's mask ones always sit over its own adapter's columns."""
    return [(a, a.rank) for a in adapters if module in a.modules] or [(None, 1)]


class StepLora:
    """The adapters of one engine step: `groups` = [(adapter, row indices)] over the packed rows.

    `delta(layer, module, x)` is the numpy path; `feeds(graph)` gives fused onnxruntime graph `graph` its
    inputs (onnx_graphs._Graph.lora). Per graph module (o, gate, up, down, and q/k/v as one): the A^T of
    the step's adapters that target it, side by side [in, R], their scaled B^T stacked [R, out] (q/k/v:
    block-diagonal over the three outputs), and a row mask [N, R] with ones on the columns of a row's own
    adapter, so that ((x·A)∘mask)·B adds each row its own adapter's delta and exactly 0 to the others.
    R counts only the adapters that touch the module (at least 1: an all-zero column when none does).

    `int8` (the model's matmuls are int8): x·A is an int8 product too, as the base matmul beside it is:
    x's rows quantized as that matmul quantizes them, A one scale per column (`LoraAdapter.a_int8`). A
    quarter of A's bytes is what it buys: the step's A and B stacks are read from memory every step,
    and their bytes, not their multiply-adds, are what LoRA costs a 16-row step. B stays float32 (an int8
    B would need the low-rank product's rows quantized, five more small ops, slower when measured)."""

    def __init__(self, groups: list[tuple[LoraAdapter, np.ndarray]], num_rows: int, stacks=None, int8: bool = False):
        self.groups, self.num_rows, self.int8 = groups, num_rows, int8
        self.stacks = stacks or StackCache()  # shared across steps with the same adapters
        rows_of = {id(a): rows for a, rows in groups}
        self.masks = {}
        for gm, parts in GRAPH_MODULES.items():
            cols = []
            for m in parts:
                for adapter, rank in module_columns([a for a, _ in groups], m):
                    col = np.zeros((num_rows, rank), np.float32)
                    if adapter is not None:
                        col[rows_of[id(adapter)]] = 1.0
                    cols.append(col)
            self.masks[gm] = np.ascontiguousarray(np.concatenate(cols, axis=1))
        self._feeds: dict[int, dict[str, np.ndarray]] = {}

    def same_rows(self, groups: list[tuple[LoraAdapter, np.ndarray]], num_rows: int) -> bool:
        """Whether a step with these groups can reuse this one (decode steps mostly repeat the last one)."""
        return num_rows == self.num_rows and len(groups) == len(self.groups) and all(
            a is b and np.array_equal(r, s) for (a, r), (b, s) in zip(groups, self.groups))

    def delta(self, layer: int, module: str, x: np.ndarray, out_dim: int) -> np.ndarray | None:
        out = None
        for adapter, rows in self.groups:
            pair = adapter.weights.get((layer, module))
            if pair is None:
                continue
            if out is None:
                out = np.zeros((x.shape[0], out_dim), np.float32)
            low = linear_int8(x[rows], *adapter.a_int8(layer, module)) if self.int8 else x[rows] @ pair[0]
            out[rows] = low @ pair[1]
        return out

    def feeds(self, graph: int, config) -> dict[str, np.ndarray]:
        """Inputs of fused graph `graph` (the end of layer graph - 1, the start of layer `graph`)."""
        if graph not in self._feeds:
            stack = self.stacks.get([a for a, _ in self.groups], config, self.int8)[graph]
            masks = {f"{gm}_mask": self.masks[gm] for gm, _ in graph_modules(graph, config.num_layers)}
            self._feeds[graph] = {**stack, **masks}
        return self._feeds[graph]


class StackCache:
    """The stacked A / B feeds of the last few adapter combinations (the engine lists a step's adapters
    in name order, so the same set is the same key; a few sets recur as requests come and go)."""

    def __init__(self, size: int = 8):
        self.size = size
        self.entries: OrderedDict[tuple, list] = OrderedDict()

    def get(self, adapters: list[LoraAdapter], config, int8: bool = False) -> list[dict[str, np.ndarray]]:
        """Per fused graph: `<module>_A` (int8: `<module>_Aq` and `<module>_Ascale`) and `<module>_B`."""
        key = (int8,) + tuple(a.identity for a in adapters)
        if key in self.entries:
            self.entries.move_to_end(key)
        else:
            self.entries[key] = _stack(adapters, config, int8)
            if len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return self.entries[key]


def _stack(adapters, config, int8: bool) -> list[dict[str, np.ndarray]]:
    shapes = module_shapes(config)
    graphs = []
    for graph in range(config.num_layers + 1):
        feeds = {}
        for gm, layer in graph_modules(graph, config.num_layers):
            a_cols, a_scales, b_blocks = [], [], []
            out_dims = [shapes[m][1] for m in GRAPH_MODULES[gm]]
            for i, m in enumerate(GRAPH_MODULES[gm]):
                d_in = shapes[m][0]
                for adapter, rank in module_columns(adapters, m):
                    pair = adapter.weights.get((layer, m)) if adapter is not None else None
                    b = np.zeros((rank, sum(out_dims)), np.float32)  # q/k/v: block-diagonal
                    if pair is None:  # zero columns keep the widths the step's masks have
                        a_cols.append(np.zeros((d_in, rank), np.int8 if int8 else np.float32))
                        a_scales.append(np.ones(rank, np.float32))
                    elif int8:
                        q, scale = adapter.a_int8(layer, m)
                        a_cols.append(q.T)
                        a_scales.append(scale)
                    else:
                        a_cols.append(pair[0])
                    if pair is not None:
                        b[:, sum(out_dims[:i]):sum(out_dims[:i + 1])] = pair[1]
                    b_blocks.append(b)
            a = np.ascontiguousarray(np.concatenate(a_cols, axis=1))
            if int8:
                feeds[f"{gm}_Aq"], feeds[f"{gm}_Ascale"] = a, np.concatenate(a_scales)
            else:
                feeds[f"{gm}_A"] = a
            feeds[f"{gm}_B"] = np.ascontiguousarray(np.concatenate(b_blocks))
        graphs.append(feeds)
    return graphs


class LoraPool:
    """At most `max_loras` adapters in memory, LRU; loads run on a background thread.

    The engine loop calls `acquire(name)` for each request waiting on an adapter: the adapter (pinned
    until `release`) once loaded, None while it loads or waits for a free slot; a load failure raises
    AdapterLoadError once for every request waiting then. `on_change` is called (from the loader
    thread) when a load ends, so the engine loop wakes up."""

    def __init__(self, lora_dir: str | Path, max_loras: int, max_rank: int, config, on_change=lambda: None):
        self.dir = Path(lora_dir)
        self.max_loras, self.max_rank, self.config = max_loras, max_rank, config
        self.on_change = on_change
        self.loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # LRU: least recently used first
        self.pins: dict[str, int] = {}
        self.loading: set[str] = set()
        self.failed: dict[str, Exception] = {}
        self.version = 0  # bumped whenever a waiting request may be able to go on
        self.loads = self.evictions = 0
        self.requests: dict[str, int] = {}
        self.stacks = StackCache()
        self._lock = threading.Lock()

    # -- names ------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        try:
            return sorted(p.name for p in self.dir.iterdir() if (p / "adapter_config.json").is_file())
        except OSError:
            return []

    def resolve(self, name: str | None = None, lora_task_id: int | None = None) -> str:
        """The adapter folder name for a name or a task id; AdapterNotFoundError names what is missing."""
        available = self.names()
        if name is not None:
            if name not in available:
                raise AdapterNotFoundError(f"adapter {name!r} not found in {self.dir} "
                                           f"(available: {', '.join(available) or 'none'})")
            if lora_task_id is not None and task_id(name) != lora_task_id:
                raise AdapterNotFoundError(f"lora_task_id {lora_task_id} is not adapter {name!r}'s ({task_id(name)})")
            return name
        for candidate in available:
            if task_id(candidate) == lora_task_id:
                return candidate
        raise AdapterNotFoundError(f"lora_task_id {lora_task_id}: no adapter in {self.dir} has this task id "
                                   f"(available: {', '.join(available) or 'none'})")

    def count_request(self, name: str) -> None:
        with self._lock:
            self.requests[name] = self.requests.get(name, 0) + 1

    # -- engine loop --------------------------------------------------------------------------------
    def acquire(self, name: str) -> LoraAdapter | None:
        with self._lock:
            if name in self.loaded:
                self.loaded.move_to_end(name)
                self.pins[name] = self.pins.get(name, 0) + 1
                return self.loaded[name]
            if name in self.failed:
                raise self.failed[name]
            if name in self.loading:
                return None
            if len(self.loaded) + len(self.loading) >= self.max_loras and not self._evict_one():
                return None  # every slot holds an adapter in use: wait for one to be released
            self.loading.add(name)
        threading.Thread(target=self._load, args=(name,), name=f"lora-load-{name}", daemon=True).start()
        return None

    def forget_failures(self) -> None:
        """After a step has failed every request waiting on a broken adapter: the next request retries."""
        with self._lock:
            self.failed.clear()

    def release(self, adapter: LoraAdapter) -> None:
        with self._lock:
            n = self.pins.get(adapter.name, 0) - 1
            if n > 0:
                self.pins[adapter.name] = n
                return
            self.pins.pop(adapter.name, None)
            self.version += 1  # its slot may be what a waiting load needs

    def _evict_one(self) -> bool:
        for name in self.loaded:  # least recently used first
            if not self.pins.get(name):
                del self.loaded[name]
                self.evictions += 1
                return True
        return False

    def _load(self, name: str) -> None:
        try:
            adapter = load_adapter(self.dir / name, self.config, self.max_rank)
        except Exception as e:  # noqa: BLE001  (any failure is reported to the requests waiting for it)
            error = e if isinstance(e, (AdapterLoadError, AdapterNotFoundError)) else \
                AdapterLoadError(f"adapter {name!r}: cannot load: {type(e).__name__}: {e}")
            with self._lock:
                self.loading.discard(name)
                self.failed[name] = error
                self.version += 1
        else:
            with self._lock:
                self.loading.discard(name)
                self.loaded[name] = adapter
                self.loads += 1
                self.version += 1
        self.on_change()

    def stats(self) -> dict:
        with self._lock:
            return {"lora_adapters_loaded": len(self.loaded), "lora_max_adapters": self.max_loras,
                    "lora_loads": self.loads, "lora_evictions": self.evictions,
                    "lora_requests": dict(self.requests)}
