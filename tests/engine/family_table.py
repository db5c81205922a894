"""The issue's family table, re-measured the way the issue measured it: a tiny random model of each
family saved as an HF folder with the packaged SmolLM2 tokenizer, fp32, then greedy
`python -m engine generate` (a separate process, as a user runs it) against transformers' own
generate() on the same folder and the same chat-templated prompt.

    .venv/bin/python tests/engine/family_table.py [--new-tokens 32] [--block-size 4] [family ...]

Prints a markdown row per family: parity (and from which token it differs), or the one-line
refusal. The prompt (a system prompt and a question through SmolLM2's chat template, ~40
tokens) runs far past the tiny configs' 8-token sliding windows; block size 4 and prefill chunks
of 7 put window edges inside blocks and chunks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE.parent)]

# The rows, then the families the brief names besides.
FAMILIES = {
    "Qwen2": "qwen2",
    "Qwen3": "qwen3",
    "Qwen3-MoE": "qwen3_moe",
    "Phi-3": "phi3",
    "OLMo2": "olmo2",
    "Granite": "granite",
    "SmolLM3": "smollm3",
    "Cohere": "cohere",
    "Mistral (sliding window)": "mistral",
    "Starcoder2 (sliding window)": "starcoder2",
    "Gemma 3 (sliding and full layers)": "gemma3_text",
    "GPT-2 (no separate KV heads, learned positions)": "gpt2",
    "StableLM (partial rotary)": "stablelm",
    "Gemma 2 (soft-capping, sliding)": "gemma2",
    "gpt-oss (sinks, sliding)": "gpt_oss",
    "GPT-NeoX (partial rotary, MHA)": "gpt_neox",
    "Llama": "llama",
    "Falcon": "falcon",
}
SYSTEM = "You are a concise assistant who answers in one short paragraph."
PROMPT = "Explain what a paged KV cache is and why it helps a chat server."


def save_family(model_type: str, folder: Path, tokenizer) -> None:
    import torch
    from family_configs import tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    config.vocab_size = len(tokenizer)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, name, getattr(tokenizer, name, None))
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def reference(folder: Path, new_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(
            ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, ids.shape[1] :].tolist()


def engine_generate(folder: Path, new_tokens: int, block_size: int) -> tuple[int, dict | str]:
    argv = [sys.executable, "-m", "engine", "generate", "--model", str(folder), "--device", "cpu"]
    argv += ["--dtype", "float32", "--temperature", "0", "--ignore-eos", "--max-new-tokens", str(new_tokens)]
    argv += ["--block-size", str(block_size), "--prefill-chunk", "7", "--system", SYSTEM, "--prompt", PROMPT]
    run = subprocess.run(argv + ["--json"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    if run.returncode != 0:
        return run.returncode, (run.stderr.strip().splitlines() or ["?"])[-1]
    return 0, json.loads(run.stdout)


def row(name: str, model_type: str, tokenizer, new_tokens: int, block_size: int, work: Path) -> str:
    folder = work / model_type
    save_family(model_type, folder, tokenizer)
    code, result = engine_generate(folder, new_tokens, block_size)
    if code == 2:  # the CLI's exit for input it refuses, with its one-line reason
        return f"| {name} | refused: {result.removeprefix('error: ')} |"
    if code != 0:
        return f"| {name} | fails (exit {code}): {result.removeprefix('error: ')} |"
    ref = reference(folder, new_tokens)
    got = result["token_ids"]
    prompt = result["prompt_tokens"]
    if got == ref:
        return f"| {name} | token-for-token parity ({len(got)} tokens after a {prompt}-token prompt) |"
    first = (
        next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b) if got[: len(ref)] != ref else len(ref)
    )
    return f"| {name} | DIFFERENT from token {first} of {len(ref)} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="model types (default: the table's)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=4)
    args = parser.parse_args()
    from engine.model.default_model import load_default_tokenizer

    tokenizer = load_default_tokenizer()
    chosen = {n: t for n, t in FAMILIES.items() if not args.families or t in args.families}
    print("| family | result |\n|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, model_type in chosen.items():
            print(row(name, model_type, tokenizer, args.new_tokens, args.block_size, Path(tmp)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
