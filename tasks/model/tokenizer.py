"""A byte-level tokenizer built locally: one token per UTF-8 byte, no merges.

Each digit, operator, letter, space and newline is its own token (ids 0-255 are the
byte values), so arithmetic is tokenised digit by digit and any text round-trips
losslessly (after Unicode NFC normalisation, as Qwen's tokenizer does). Special tokens
follow Qwen's names; reserved tokens pad the vocabulary to the model's size so that
every id the model can sample decodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
NUM_BYTE_TOKENS = 256
MIN_VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
"""Hermes/Qwen tool-call tags: a call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

# Qwen's ChatML layout; optional for callers (plain prompts need no template). Without
# tools the text is plain ChatML; with tools a short system block lists each tool's name
# and parameter names (the model is tiny), assistant tool calls follow their content as
# Hermes blocks, and tool results are role ``tool`` turns. Content None renders as empty.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\nTools: ' }}"
    "{%- for tool in tools %}"
    "{%- set f = tool.function if tool.function is defined else tool %}"
    "{%- set params = f.parameters.properties if f.parameters is defined and f.parameters.properties is defined"
    " else {} %}"
    "{{ f.name + '(' + (params | list | join(', ')) + ')' }}{{ ', ' if not loop.last }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set f = call.function if call.function is defined else call %}"
    "{{ '\\n' if loop.index0 > 0 or message['content'] }}"
    "{{ '" + TOOL_CALL_OPEN + "\\n{\"name\": ' + (f.name | tojson) + ', \"arguments\": ' }}"
    "{{ f.arguments if f.arguments is string else (f.arguments | tojson) }}"
    "{{ '}\\n" + TOOL_CALL_CLOSE + "' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel alphabet).

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to
    chr(256 + j), j = their rank among the non-printable bytes.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(NUM_BYTE_TOKENS):
        if b not in mapping:
            mapping[b] = chr(NUM_BYTE_TOKENS + extra)
            extra += 1
    return mapping


def special_token_ids() -> dict[str, int]:
    """Ids of the special tokens: 256, 257, ... in SPECIAL_TOKENS order."""
    return {token: NUM_BYTE_TOKENS + i for i, token in enumerate(SPECIAL_TOKENS)}


def build_tokenizer(vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer with ``vocab_size`` ids: 256 bytes, the special tokens, then
    ``<|reserved_i|>`` tokens up to ``vocab_size``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"build_tokenizer: vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + specials), got {vocab_size}"
        )
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # transformers' Qwen2Tokenizer (what AutoTokenizer picks for model_type qwen2) applies
    # NFC; doing the same here keeps tokenizer.json and AutoTokenizer in agreement.
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - MIN_VOCAB_SIZE)]
    core.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in (*SPECIAL_TOKENS, *reserved)]
    )
    if core.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(
            f"build_tokenizer: built {core.get_vocab_size(with_added_tokens=True)} ids, expected {vocab_size}"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
