"""postprocessing: tensors in, `text.postprocess.detokenize_batch`, tensors out."""
import triton_python_backend_utils as pb_utils

from contracts import triton_io as io
from contracts.tensors import POSTPROCESSING
from text.detokenize import Detokenizer
from contracts.errors import to_triton_error
from text.postprocess import detokenize_batch
from text.tokenization import TokenizerBundle


class TritonPythonModel:
    def initialize(self, args):
        p = io.model_parameters(args)
        tokenizer = TokenizerBundle.load(p["tokenizer_dir"]).tokenizer
        self.detok = Detokenizer.from_tokenizer(tokenizer, p.get("skip_special_tokens", "true") == "true")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                x = io.inputs(request, POSTPROCESSING)
                text = detokenize_batch(self.detok, x["TOKENS_BATCH"], x["SEQUENCE_LENGTH"])
                responses.append(pb_utils.InferenceResponse(io.tensors(pb_utils, {"OUTPUT": text})))
            except Exception as e:
                responses.append(pb_utils.InferenceResponse(error=to_triton_error(pb_utils, e)))
        return responses
