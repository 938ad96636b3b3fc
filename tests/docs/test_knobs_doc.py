"""docs/knobs.md is generated from the knob tables (build/knobs_doc.py) and the engine's defaults are
defined once (cpu_engine/config.py EngineConfig): the doc, the renderer and the engine cannot disagree."""
import pytest

from build import knobs_doc, render
from cpu_engine.config import parameter_defaults


def test_the_committed_knobs_doc_is_current():
    assert knobs_doc.DOC.read_text() == knobs_doc.generate(), "stale: run python build/knobs_doc.py"


def test_a_changed_default_changes_the_doc(monkeypatch):
    monkeypatch.setitem(render.COMMON, "max_queue_size", "777")
    assert "| `max_queue_size` | 777 |" in knobs_doc.generate()


def test_a_knob_without_a_meaning_fails_the_generation(monkeypatch):
    monkeypatch.setitem(render.TARGET_DEFAULTS["cpu"], "brand_new_knob", "1")
    with pytest.raises(knobs_doc.UndocumentedKnob, match="brand_new_knob"):
        knobs_doc.generate()


def test_the_cpu_repository_renders_the_engine_defaults():
    engine = parameter_defaults()
    rendered = {**render.COMMON, **render.TARGET_DEFAULTS["cpu"]}
    shared = [k for k in engine if rendered.get(k) is not None]  # None: derived when rendering
    assert {"max_num_tokens", "max_queue_size", "max_engine_batch_size", "weight_dtype"} <= set(shared)
    assert {k: rendered[k] for k in shared} == {k: engine[k] for k in shared}
