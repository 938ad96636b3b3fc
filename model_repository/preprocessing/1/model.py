"""preprocessing: tensors in, `text.preprocess.Preprocessor`, tensors out."""
import triton_python_backend_utils as pb_utils

from contracts import triton_io as io
from contracts.tensors import PREPROCESSING
from contracts.errors import to_triton_error
from text.preprocess import Preprocessor
from text.tokenization import TokenizerBundle


class TritonPythonModel:
    def initialize(self, args):
        p = io.model_parameters(args)
        self.preprocess = Preprocessor(
            TokenizerBundle.load(p["tokenizer_dir"]), int(p["max_seq_len"]), int(p["max_output_len"])
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                x = io.inputs(request, PREPROCESSING)
                out = self.preprocess(
                    query=io.scalar(x, "QUERY"),
                    request_output_len=io.scalar(x, "REQUEST_OUTPUT_LEN"),
                    bad_words=x.get("BAD_WORDS_DICT"),
                    stop_words=x.get("STOP_WORDS_DICT"),
                    end_id=io.scalar(x, "END_ID"),
                    pad_id=io.scalar(x, "PAD_ID"),
                    messages=io.scalar(x, "MESSAGES"),
                    min_tokens=io.scalar(x, "MIN_TOKENS"),
                    min_length=io.scalar(x, "MIN_LENGTH"),
                    tools=io.scalar(x, "TOOLS"),
                    prompt_ids=x.get("PROMPT_IDS"),
                )
                responses.append(pb_utils.InferenceResponse(io.tensors(pb_utils, out)))
            except Exception as e:  # every failure becomes a contract error response
                responses.append(pb_utils.InferenceResponse(error=to_triton_error(pb_utils, e)))
        return responses
