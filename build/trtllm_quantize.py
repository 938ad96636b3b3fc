"""FP8 post-training quantization inside the pinned container, without TensorRT-LLM's examples folder.

NGC's `tritonserver:*-trtllm-python-py3` images ship the `tensorrt_llm` wheel but not the repository's
`examples/` (tensorrtllm_backend issues #721, #739: no /app there), so `examples/quantization/quantize.py`
is not in the image. That script is a command line over the wheel's
`tensorrt_llm.quantization.quantize_and_export`; this one is too, with the same flag names, and it
passes only the keywords the installed version's signature has (its keyword set changes across
versions). `build/trtllm.py build` runs it as

    python3 /project/build/trtllm_quantize.py --model_dir /ckpt --output_dir /engine/ckpt-fp8 \
        --dtype bfloat16 --qformat fp8 --kv_cache_dtype fp8 --calib_size 512 \
        [--calib_dataset /calib/cnn_dailymail] --tp_size 1 --pp_size 1
"""
from __future__ import annotations

import argparse
import inspect
import sys

# quantize.py's defaults for what this project does not set
DEFAULTS = {"device": "cuda", "batch_size": 1, "calib_max_seq_length": 512, "awq_block_size": 128, "cp_size": 1,
            "seed": 1234, "tokenizer_max_seq_length": 2048, "calib_dataset": "cnn_dailymail"}


def parse(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--qformat", default="fp8")
    p.add_argument("--kv_cache_dtype", default="fp8")
    p.add_argument("--calib_size", type=int, default=512)
    p.add_argument("--calib_dataset", default=DEFAULTS["calib_dataset"],
                   help="a Hugging Face name, or a local folder whose path contains 'cnn_dailymail'")
    p.add_argument("--tp_size", type=int, default=1)
    p.add_argument("--pp_size", type=int, default=1)
    return {**DEFAULTS, **{k: v for k, v in vars(p.parse_args(argv)).items() if v is not None}}


def call_with_known_keywords(fn, options: dict):
    """Call `fn` with the options its signature names; fail clearly if it needs one we lack."""
    params = inspect.signature(fn).parameters
    needed = [n for n, prm in params.items()
              if prm.default is inspect.Parameter.empty
              and prm.kind in (prm.KEYWORD_ONLY, prm.POSITIONAL_OR_KEYWORD) and n not in options]
    if needed:
        raise SystemExit(f"trtllm_quantize: this TensorRT-LLM's quantize_and_export also needs {', '.join(needed)}")
    return fn(**{k: v for k, v in options.items() if k in params})


def main(argv=None) -> int:
    options = parse(argv)
    from tensorrt_llm.quantization import quantize_and_export  # only inside the container

    call_with_known_keywords(quantize_and_export, options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
