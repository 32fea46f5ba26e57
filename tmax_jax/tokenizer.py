"""Tokenizers: load a checkpoint's tokenizer (with its chat template) and train a tiny local one.

The tiny tokenizer is a byte-level BPE with Qwen's special tokens and a Qwen 3.5-style chat template
(tools list, XML tool calls, ``tool`` role messages, ``<think>`` blocks), so a new user can run the
whole stack offline on a random tiny checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tmax_jax.errors import CheckpointError

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

# Qwen 3.5's conventions: ChatML turns, tool schemas in the system turn, calls as
# <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>,
# tool results as <tool_response> blocks inside a user turn, reasoning inside <think>.
CHAT_TEMPLATE = (
    "{%- set think = enable_thinking if enable_thinking is defined else true -%}"
    "{%- set has_system = messages and messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if has_system -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with exactly this format:\\n\\n<tool_call>\\n"
    "<function=example_function_name>\\n<parameter=example_parameter>\\nvalue\\n</parameter>\\n</function>\\n"
    "</tool_call><|im_end|>\\n' -}}"
    "{%- elif has_system -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}"
    "{%- if not loop.first -%}{{- '<|im_start|>system\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif m['role'] == 'user' -%}"
    "{{- '<|im_start|>user\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if m.get('reasoning_content') -%}"
    "{{- '<think>\\n' + m['reasoning_content'] + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- m.get('content') or '' -}}"
    "{%- for call in (m.get('tool_calls') or []) -%}"
    "{%- set f = call['function'] if call.get('function') else call -%}"
    "{%- if not loop.first or m.get('content') -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n<function=' + f['name'] + '>\\n' -}}"
    "{%- if f['arguments'] is mapping -%}"
    "{%- for key, value in f['arguments'].items() -%}"
    "{{- '<parameter=' + key + '>\\n' -}}"
    "{%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}"
    "{{- '\\n</parameter>\\n' -}}"
    "{%- endfor -%}"
    "{%- else -%}{{- f['arguments'] + '\\n' -}}"
    "{%- endif -%}"
    "{{- '</function>\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if think -%}{{- '<think>\\n' -}}{%- else -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

_CORPUS = (
    "ls -la /tmp && cat README.md | head -n 20",
    "grep -rn 'def main' src/ --include='*.py'",
    "find . -name '*.json' -exec wc -l {} +",
    "python3 -c 'import sys; print(sys.version)'",
    "echo $HOME; cd /app && make test 2>&1 | tail",
    "The task is complete. All tests passed.",
    "I will inspect the directory structure first, then run the verifier.",
    "sed -i 's/foo/bar/g' config.yaml && git diff --stat",
    "curl -s http://localhost:8080/health || echo down",
    "tar -xzf data.tar.gz -C /workdir && ls /workdir",
    'for f in *.txt; do sort -u "$f" > "$f.sorted"; done',
    '{"name": "bash", "arguments": {"command": "pwd"}}',
)


def load_tokenizer(path: str | Path):
    """The checkpoint directory's tokenizer (transformers), chat template included."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{path}: missing tokenizer.json / tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(path))


def train_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512, corpus: Iterable[str] | None = None):
    """Trains a byte-level BPE on a small built-in shell/agent corpus and saves it (with chat
    template) to ``out_dir``; returns the transformers tokenizer. Special tokens take the first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = list(corpus) if corpus is not None else list(_CORPUS) * 4
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE (>= {256 + len(SPECIAL_TOKENS)})"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast
