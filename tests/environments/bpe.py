"""A real byte-level BPE tokenizer with a Qwen-style chat template that takes ``tools=``, trained
here on a small corpus (no hub), and a random Qwen2 model over it whose end-of-turn token is likely."""

from __future__ import annotations

import torch

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": NAME, "arguments": {"input": TEXT}}</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n"
    "<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "What is 12 + 7 - 3? Let me compute: 12 + 7 = 19, 19 - 3 = 16. #### 16",
    '<tool_call>{"name": "calc", "arguments": {"input": "12+7-3"}}</tool_call>',
    "<tool_response>\n16\n</tool_response> The answer is 16.",
    "the quick brown fox jumps over the lazy dog; numbers 0123456789 and + - * / = ( )",
] * 20


def bpe_tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    out.chat_template = CHAT_TEMPLATE
    return out


def random_qwen2(tok, seed: int = 0, eos_scale: float = 30.0):
    """A random two-layer Qwen2 whose tied EOS row is scaled, so turns end at varied lengths."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.get_input_embeddings().weight[tok.eos_token_id] *= eos_scale
    return model.eval()
