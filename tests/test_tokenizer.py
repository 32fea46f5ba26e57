"""The tiny byte-level BPE and its Qwen 3.5-style chat template, loaded back through transformers."""

import pytest
from helpers_hf import make_tiny_hf_checkpoint, train_tiny_tokenizer

from tmax_jax.errors import CheckpointError
from tmax_jax.tokenizer import SPECIAL_TOKENS, load_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
EPISODE = [
    {"role": "system", "content": "You are a terminal agent."},
    {"role": "user", "content": "How many files are in /data?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Count them with ls.",
        "tool_calls": [
            {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls /data | wc -l"}}}
        ],
    },
    {"role": "tool", "content": "3"},
    {"role": "assistant", "content": "There are 3 files."},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tiny_tokenizer(out)
    return load_tokenizer(out)


def test_special_tokens_are_single_ids_and_text_round_trips(tok):
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert len(set(ids.values())) == len(SPECIAL_TOKENS) and all(i < 16 for i in ids.values())
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "grep -rn 'TODO' src/ | sort -u\n\tünïcödé ✓"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<tool_call>x</tool_call>")[0] == ids["<tool_call>"]


def test_chat_template_renders_tools_xml_tool_calls_and_tool_results(tok):
    text = tok.apply_chat_template(EPISODE, tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a terminal agent.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "bash"' in text
    call = (
        "<|im_start|>assistant\n<think>\nCount them with ls.\n</think>\n\n"
        "<tool_call>\n<function=bash>\n<parameter=command>\nls /data | wc -l\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n"
    )
    assert call in text
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\nThere are 3 files.<|im_end|>\n")


def test_generation_prompt_opens_a_thinking_or_a_closed_think_block(tok):
    msgs = EPISODE[:2]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>user\nHow many files are in /data?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "# Tools" not in off and off.startswith(
        "<|im_start|>system\nYou are a terminal agent.<|im_end|>\n"
    )


def test_consecutive_tool_messages_share_one_user_turn(tok):
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "tool", "content": "a"},
        {"role": "tool", "content": "b"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response><|im_end|>\n"
    )


def test_load_from_a_checkpoint_dir_and_missing_tokenizer_is_named(tmp_path):
    ckpt = make_tiny_hf_checkpoint(tmp_path, tokenizer=True, vocab_size=512)
    tok = load_tokenizer(ckpt)
    assert tok.chat_template and tok.convert_tokens_to_ids("<|im_start|>") == SPECIAL_TOKENS.index(
        "<|im_start|>"
    )
    bare = make_tiny_hf_checkpoint(tmp_path, name="bare")
    with pytest.raises(CheckpointError, match="missing tokenizer.json"):
        load_tokenizer(bare)
