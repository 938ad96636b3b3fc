"""Each fact of issue 19 has one definition a reader can grep; these fail when a second copy appears in
product code (string constants and calls, not prose: docstrings and comments may name a fact)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("contracts", "text", "gateway", "ledger", "cpu_engine", "front", "model_repository", "build", "benchmarks",
           "clients", "launcher", "loadtest")


def product_files():
    for d in PRODUCT:
        yield from sorted((ROOT / d).rglob("*.py"))


def constants(tree) -> set:
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in docstrings}


def attribute_calls(tree) -> set:
    return {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}


def where(predicate) -> list[str]:
    out = []
    for p in product_files():
        tree = ast.parse(p.read_text(), str(p))
        if predicate(tree):
            out.append(str(p.relative_to(ROOT)))
    return sorted(out)


def test_the_scan_sees_constants_but_not_docstrings():
    tree = ast.parse('"""x-.*|authorization"""\ndef f():\n    """doc"""\n    return "SmolLM2-135M-Instruct"\n')
    assert constants(tree) == {"SmolLM2-135M-Instruct"}


def test_the_default_checkpoint_is_named_once():
    assert where(lambda t: "SmolLM2-135M-Instruct" in constants(t)) == ["build/prepare_model.py"]


def test_max_position_embeddings_is_read_once():
    # the one reader, and the GGUF converter that writes the checkpoint's config.json
    assert where(lambda t: "max_position_embeddings" in constants(t)) == ["build/prepare_model.py",
                                                                          "cpu_engine/hf_config.py"]


def test_the_header_forward_pattern_is_written_once():
    assert where(lambda t: any(isinstance(c, str) and "x-.*|authorization" in c for c in constants(t))) \
        == ["build/triton_flags.py"]


def test_the_api_key_is_read_from_its_headers_once():
    """`authorization: Bearer`, `x-api-key`: the front and the gateway read a key through one function."""
    assert where(lambda t: "x-api-key" in constants(t)) == ["contracts/api_keys.py"]


def test_the_engines_sampling_ranges_are_checked_once():
    """The engine's tensor contract and its submit both take the ranges from SamplingParams.problems."""
    names = lambda t: {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}  # noqa: E731
    assert where(lambda t: {"MAX_TEMPERATURE", "MAX_PENALTY"} & names(t)) == ["cpu_engine/sequence.py"]


def test_percentiles_are_computed_once():
    assert where(lambda t: "percentile" in attribute_calls(t)) == ["contracts/measures.py"]


def test_prometheus_text_is_parsed_once():
    assert where(lambda t: "text_string_to_metric_families" in constants(t) | {
        n.id for n in ast.walk(t) if isinstance(n, ast.Name)}) == ["clients/prometheus.py"]


def test_throughput_is_divided_out_once():
    """Throughput figures go through contracts.measures.throughput: no other module divides by a time span
    of its own (the pattern each of the three reports used: `/ (last - first)`, `/ span`, `/ wall`)."""
    def divides_by_a_span(t):
        return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) and (
            isinstance(n.right, ast.Name) and n.right.id in ("span", "wall")
            or isinstance(n.right, ast.BinOp) and isinstance(n.right.op, ast.Sub)
            and {getattr(n.right.left, "id", None), getattr(n.right.right, "id", None)} == {"last", "first"})
            for n in ast.walk(t))
    assert where(divides_by_a_span) == []


def _decides_finish_reason(t) -> bool:
    """`"length" if ... else ...`, or a count compared `>=` to a max_tokens: the rule of contracts.generation."""
    def named_max_tokens(n):
        return getattr(n, "id", None) == "max_tokens" or getattr(n, "attr", None) == "max_tokens"
    return any(isinstance(n, ast.IfExp)
               and "length" in (getattr(n.body, "value", None), getattr(n.orelse, "value", None))
               or isinstance(n, ast.Compare) and isinstance(n.ops[0], ast.GtE) and named_max_tokens(n.comparators[0])
               for n in ast.walk(t))


def test_the_finish_reason_scan_sees_both_shapes_of_the_rule():
    assert _decides_finish_reason(ast.parse('r = "length" if n >= m else "stop"'))
    assert _decides_finish_reason(ast.parse('r = any(c >= call.max_tokens for c in counts)'))
    assert not _decides_finish_reason(ast.parse('r = piece.finish_reason or "stop"'))


def test_the_finish_reason_is_decided_once():
    """Whoever reads the engine's stream (the gateway, the front on a lease) counts with
    contracts.generation.GeneratedCounts; every other layer passes the reason on. The CPU engine's own
    reasons (end_id, stop_words, cancelled) stay inside it: TensorRT-LLM's outputs carry none."""
    assert [p for p in where(_decides_finish_reason) if not p.startswith("cpu_engine/")] == ["contracts/generation.py"]


def test_tenant_model_permission_is_decided_once():
    """Tenant.model_refusal alone reads a tenant's allowed_models and a model's tiers; requests, routing,
    fallbacks, the model list and the response cache ask it."""
    def reads_permission(t):
        return "allowed_models" in {n.attr for n in ast.walk(t) if isinstance(n, ast.Attribute)} \
            or "eligible" in attribute_calls(t)
    assert where(reads_permission) == ["gateway/tenants.py"]


def _compares_prompt_plus_max_tokens(t) -> bool:
    """A bound compared to a sum with max_tokens (or the engine's max_new_tokens) in it."""
    def adds_max_tokens(n):
        return isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add) and any(
            getattr(x, "id", None) in ("max_tokens", "max_new_tokens")
            or getattr(x, "attr", None) in ("max_tokens", "max_new_tokens") for x in (n.left, n.right))
    return any(isinstance(n, ast.Compare) and (adds_max_tokens(n.left) or any(map(adds_max_tokens, n.comparators)))
               for n in ast.walk(t))


def test_prompt_plus_max_tokens_is_checked_once_per_owner():
    """Whether prompt + max_tokens fit: the tenant's quota (Tenant.context_refusal, its policy), the model's
    context and what its engine can hold (gateway/routing.py context_refusal, the gateway's one decision),
    and the engine's own invariant (cpu_engine/engine.py check_max_seq_len, which the simulated GPU shares
    too). Preprocessing and the rest of the gateway trust them."""
    assert _compares_prompt_plus_max_tokens(ast.parse("ok = len(ids) + max_tokens > self.max_seq_len"))
    assert where(_compares_prompt_plus_max_tokens) == ["cpu_engine/engine.py", "gateway/routing.py",
                                                       "gateway/tenants.py"]


def test_sampling_ranges_are_checked_by_the_front_and_the_engine_only():
    """OpenAI's ranges where OpenAI's fields enter (front/openai_schema.py), the engine's contract in the
    engine (SamplingParams.problems); the gateway passes sampling on (gateway/request.py says why)."""
    fields = {"temperature", "top_p", "presence_penalty", "frequency_penalty"}

    def bounds_a_sampling_field(t):  # a call naming the field with both bounds: _float(body, "top_p", 0.0, 1.0)
        return any(isinstance(n, ast.Call) and fields & {a.value for a in n.args if isinstance(a, ast.Constant)}
                   and sum(isinstance(a, ast.Constant) and type(a.value) in (int, float) for a in n.args) >= 2
                   for n in ast.walk(t))
    assert bounds_a_sampling_field(ast.parse('t = _float(body, "temperature", 0.0, 2.0)'))
    assert where(bounds_a_sampling_field) == ["cpu_engine/sequence.py", "front/openai_schema.py"]


def test_max_tokens_bounds_are_checked_once_per_door():
    """max_tokens' own bounds: OpenAI's field where it enters the front (front/openai_schema.py), Triton's
    side once in text/preprocess.py check_max_tokens (the gateway and preprocessing, the two doors
    Triton-native clients use, call it), and the engine's contract in SamplingParams.problems."""
    names = {"max_tokens", "max_completion_tokens", "request_output_len", "max_new_tokens"}

    def bounds_max_tokens(t):  # a call naming the field with its lower bound: _int(body, "max_tokens", 1, ...)
        return any(isinstance(n, ast.Call) and names & {a.value for a in n.args if isinstance(a, ast.Constant)}
                   and any(isinstance(a, ast.Constant) and a.value == 1 and type(a.value) is int for a in n.args)
                   for n in ast.walk(t))

    def compares_max_tokens_to_one(t):  # `if value < 1: raise invalid("max_tokens", ...)`
        return any(isinstance(n, ast.Compare)
                   and any(isinstance(c, ast.Constant) and c.value == 1 for c in n.comparators)
                   and any(isinstance(m, ast.Call) and any(isinstance(a, ast.Constant) and a.value in names
                                                           for a in m.args) for m in ast.walk(parent))
                   for parent in ast.walk(t) if isinstance(parent, ast.If) for n in [parent.test])

    assert bounds_max_tokens(ast.parse('m = _int(body, "max_tokens", 1, MAX_INT32)'))
    assert compares_max_tokens_to_one(ast.parse('if value < 1:\n    raise invalid("max_tokens", "x")'))
    assert where(bounds_max_tokens) == ["cpu_engine/sequence.py", "front/openai_schema.py"]
    assert where(compares_max_tokens_to_one) == ["text/preprocess.py"]
