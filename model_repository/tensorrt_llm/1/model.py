"""tensorrt_llm on the CPU: a decoupled adapter over `cpu_engine.LLMEngine`.

Tensors in -> `cpu_engine.triton_contract.parse_engine_request` -> `LLMEngine.submit`; the engine's loop thread
calls back with per-step outputs, `ResponseAssembler` turns them into responses. `stop` cancels the
request with the same id (upstream semantics), a cancelled response sender ends the sequence within
one engine step. Engine stats are exported with the TensorRT-LLM backend's metric names.
"""
import itertools
import threading

import triton_python_backend_utils as pb_utils

from contracts import triton_io as io
from contracts.tensors import ENGINE
from text.detokenize import Detokenizer
from cpu_engine.triton_contract import ResponseAssembler, parse_engine_request, stream_interval
from contracts.errors import ServingError, to_triton_error
from text.tokenization import TokenizerBundle
from cpu_engine import EngineConfig, InvalidRequestError, LLMEngine, QueueFullError
from cpu_engine.lora import AdapterNotFoundError
from cpu_engine.metrics import metric_samples
from cpu_engine.simulated_gpu import SimulatedGpuConfig, SimulatedGpuEngine, TrtllmError

FINAL = None  # pb_utils constants exist only after the stub starts


class TritonPythonModel:
    def initialize(self, args):
        global FINAL
        FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        p = io.model_parameters(args)
        self.labels = {"model": args["model_name"], "version": args["model_version"]}
        self.default_exclude_input = p.get("exclude_input_in_output", "true").lower() == "true"
        self.stream_interval = stream_interval(p.get("stream_interval", "1"))
        tokenizer = TokenizerBundle.load(p["tokenizer_dir"]).tokenizer
        self.detok = Detokenizer.from_tokenizer(tokenizer)
        if p.get("simulated_engine", "false").lower() == "true":  # capacity benchmarks only (docs/benchmarks.md)
            self.engine = SimulatedGpuEngine(SimulatedGpuConfig.from_parameters(p), tokenizer)
        else:
            self.engine = LLMEngine(EngineConfig.from_parameters(p))
        pb_utils.Logger.log_info(f"{args['model_name']}: {self.engine.describe()}")
        self.ids = itertools.count()
        self.active = {}  # client request id -> engine request id (for `stop`)
        self.engine.start()
        self.period = int(p.get("stats_check_period_ms", "100")) / 1000.0
        self.families, self.gauges = {}, {}
        self.stopping = threading.Event()
        self.exporter = threading.Thread(target=self._export_metrics, name="nv_trt_llm-metrics", daemon=True)
        self.exporter.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except TrtllmError as e:  # the simulated engine's: in TensorRT-LLM's words, as its backend sends them
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))), flags=FINAL)
            except Exception as e:
                if isinstance(e, InvalidRequestError):
                    e = ServingError("invalid_argument", str(e), field=getattr(e, "field", None))
                elif isinstance(e, AdapterNotFoundError):
                    e = ServingError("not_found", str(e), field="lora_task_id")
                elif isinstance(e, QueueFullError):
                    e = ServingError("queue_full", str(e), retry_after=1.0)
                sender.send(pb_utils.InferenceResponse(error=to_triton_error(pb_utils, e)), flags=FINAL)
        return None

    def _submit(self, request, sender):
        call = parse_engine_request(io.inputs(request, ENGINE), self.default_exclude_input)
        client_id = request.request_id()
        if call.stop:
            engine_id = self.active.get(client_id)
            if engine_id is not None:
                self.engine.cancel(engine_id)
            sender.send(flags=FINAL)
            return
        engine_id = f"{client_id or 'req'}#{next(self.ids)}"
        if client_id:
            self.active[client_id] = engine_id
        assembler = ResponseAssembler(call, self.detok if call.streaming else None, self.stream_interval)

        def on_output(out):
            for arrays, final in assembler.feed(out):
                if arrays is None:  # the request failed in the engine: its error ends the stream
                    err = to_triton_error(pb_utils, ServingError(out.error_kind or "internal", out.error))
                    sender.send(pb_utils.InferenceResponse(error=err), flags=FINAL)
                else:
                    sender.send(pb_utils.InferenceResponse(io.tensors(pb_utils, arrays)), flags=FINAL if final else 0)
            if out.ends_request and client_id and self.active.get(client_id) == engine_id:
                del self.active[client_id]

        cache_salt = io.request_parameters(request).get("cache_salt")
        self.engine.submit(engine_id, call.prompt_ids, call.params, on_output,
                           is_cancelled=sender.is_cancelled, cache_salt=cache_salt, lora_task_id=call.lora_task_id,
                           lookahead=call.lookahead, retention=call.retention, lora_weights=call.lora_weights)

    def _export_metrics(self):
        while not self.stopping.wait(self.period):
            try:
                self._set_gauges()
            except Exception as e:  # never let one bad read stop the exporter
                pb_utils.Logger.log_warn(f"nv_trt_llm metrics update failed: {e}")

    def _set_gauges(self):
        for family, description, label, value_label, value in metric_samples(self.engine.stats()):
            key = (family, value_label)
            if key not in self.gauges:
                if family not in self.families:
                    self.families[family] = pb_utils.MetricFamily(
                        name=family, description=description, kind=pb_utils.MetricFamily.GAUGE)
                self.gauges[key] = self.families[family].Metric(labels={**self.labels, label: value_label})
            self.gauges[key].set(float(value))

    def finalize(self):
        self.stopping.set()
        self.engine.shutdown()
