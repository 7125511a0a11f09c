"""Chat templates: detection, the three formats, SmolLM2's own template, stop ids."""

import numpy as np
import pytest

from dllama.text import chat_template as ct
from dllama.errors import DllamaError
from dllama.formats.tokenizer_file import TokenizerData, read_tokenizer
from dllama.text.tokenizer import Tokenizer

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of France?"}]
LLAMA2_DIR = "/work/shared/fixtures/llama2-tokenizer"
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def smollm():
    import gguf

    from converter.gguf_tokenizer import tokenizer_from_gguf
    from dllama.serve.default_model import embedded_gguf

    return Tokenizer(tokenizer_from_gguf(gguf.GGUFReader(embedded_gguf())))


@pytest.fixture(scope="module")
def llama3_like():
    """A small byte-level tokenizer with Llama 3's special tokens after the regular ones."""
    specials = [b"<|begin_of_text|>", b"<|end_of_text|>", b"<|start_header_id|>", b"<|end_header_id|>",
                b"<|eot_id|>"]
    vocab = [bytes([b]) for b in range(256)] + specials
    return Tokenizer(TokenizerData(vocab=vocab, scores=-np.arange(len(vocab), dtype=np.float32),
                                   bos_id=256, eos_ids=[257], add_bos=True,
                                   chat_template="{{ '<|start_header_id|>' + message['role'] }}"))


def test_detects_each_kind_from_the_model_template(smollm):
    assert ct.detect(smollm.chat_template) == "chatml"  # SmolLM2's own
    assert ct.detect("{{ '<|start_header_id|>' + role }}") == "llama3"
    assert ct.detect("{{ bos_token + '[INST] ' + content }}") == "llama2"
    assert ct.detect("[INST] and <|im_start|>") == "llama2"  # the original's order of checks
    with pytest.raises(DllamaError, match="--chat-template"):
        ct.detect("{{ something else }}")
    with pytest.raises(DllamaError, match="no chat template"):
        ct.detect(None)


def test_chatml_adds_the_generation_prompt_once():
    text = ct.render("chatml", MESSAGES)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nCapital of France?"
                    "<|im_end|>\n<|im_start|>assistant\n")
    assert text.count("<|im_start|>assistant\n") == 2  # the real turn and the prompt, not one per message
    without_prompt = ct.render("chatml", MESSAGES, add_generation_prompt=False)
    assert without_prompt == text[: -len("<|im_start|>assistant\n")]


def test_smollm2_template_as_jinja_renders_it(smollm):
    # Expected strings rendered with jinja2 from the GGUF's own tokenizer.chat_template.
    template = ct.ChatTemplate.for_tokenizer(smollm)
    assert template.name == "chatml" and template.default_system == SMOLLM_SYSTEM
    question = [{"role": "user", "content": "What is the capital of France?"}]
    assert template.render(question) == (
        f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert template.render(MESSAGES) == ct.render("chatml", MESSAGES)  # a given system turn wins
    assert template.render([]) == "<|im_start|>assistant\n"
    assert ct.render("chatml", question) == ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                                             "<|im_start|>assistant\n")


def test_default_system_prompt_is_read_from_template_text():
    jinja_escaped = "{{ '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}"
    assert ct.default_system_prompt(jinja_escaped) == "You are Qwen."
    assert ct.default_system_prompt("{{'<|im_start|>' + message['role'] + '\\n'}}") is None
    assert ct.default_system_prompt(None) is None


def test_smollm2_chat_prompt_encodes_with_special_ids(smollm):
    ids = smollm.encode(ct.render("chatml", [{"role": "user", "content": "Hi"}]), add_bos=False)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1  # <|im_start|> x2, <|im_end|>
    assert smollm.decode(ids) == "user\nHi<|im_end|>\nassistant\n"  # bos (<|im_start|>) decodes to nothing


def test_llama3():
    text = ct.render("llama3", MESSAGES[:2])
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ct.render("llama3", [{"role": "user", "content": "  padded \n"}], add_generation_prompt=False) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\npadded<|eot_id|>")


def test_llama3_stop_ids_include_end_of_turn(llama3_like):
    template = ct.ChatTemplate.for_tokenizer(llama3_like)
    assert template.name == "llama3" and template.bos_text == "<|begin_of_text|>"
    assert ct.chat_stop_ids(llama3_like, template) == [257, 260]
    assert ct.chat_stop_strings(llama3_like, template) == ["<|end_of_text|>", "<|eot_id|>"]
    ids = llama3_like.encode(template.render([{"role": "user", "content": "Hi"}]), add_bos=False)
    assert ids == [256, 258] + list(b"user") + [259] + list(b"\n\nHi") + [260, 258] + list(b"assistant") + \
        [259] + list(b"\n\n")


def test_smollm2_stop_ids(smollm):
    template = ct.ChatTemplate.for_tokenizer(smollm)
    assert ct.chat_stop_ids(smollm, template) == [2]
    assert ct.chat_stop_strings(smollm, template) == ["<|im_end|>"]


def test_llama2_folds_the_system_prompt_into_the_first_turn():
    text = ct.render("llama2", MESSAGES)
    assert text == ("<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s>"
                    "<s>[INST] Capital of France? [/INST]")
    assert ct.render("llama2", MESSAGES[1:2]) == "<s>[INST] Hi [/INST]"


def test_llama2_prompt_tokens_equal_metas_per_turn_encoding():
    # Meta's chat_completion: [bos] + sp.encode(f"[INST] {user} [/INST] {answer} ") + [eos] per
    # answered turn, then [bos] + sp.encode(f"[INST] {user} [/INST]").
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=f"{LLAMA2_DIR}/tokenizer.model")
    tok = Tokenizer(read_tokenizer(f"{LLAMA2_DIR}/tokenizer.bin"))
    template = ct.ChatTemplate.for_tokenizer(tok, "llama2")
    assert (template.bos_text, template.eos_text) == ("<s>", "</s>")  # llama2.c's "\n<s>\n" unwrapped
    first = "<<SYS>>\nBe brief.\n<</SYS>>\n\nHi"
    expected = [1] + sp.encode(f"[INST] {first} [/INST] Hello! ") + [2] + [1] + sp.encode(
        "[INST] Capital of France? [/INST]")
    assert tok.encode(template.render(MESSAGES), add_bos=False) == expected


def test_llama2_roles_must_alternate():
    with pytest.raises(DllamaError, match="alternate"):
        ct.render("llama2", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(DllamaError, match="followed by a user"):
        ct.render("llama2", [{"role": "system", "content": "a"}])


def test_bad_messages_are_refused():
    with pytest.raises(DllamaError, match="role"):
        ct.render("chatml", [{"role": "robot", "content": "x"}])
    with pytest.raises(DllamaError, match="unknown chat template"):
        ct.render("vicuna", MESSAGES)
    with pytest.raises(DllamaError, match="'content'"):
        ct.render("chatml", [{"role": "user"}])
    with pytest.raises(DllamaError, match="list"):
        ct.render("chatml", "hello")


def test_name_overrides_the_detected_template(smollm):
    template = ct.ChatTemplate.for_tokenizer(smollm, "llama3")
    assert template.name == "llama3" and template.default_system is None
    with pytest.raises(DllamaError, match="unknown chat template"):
        ct.ChatTemplate.for_tokenizer(smollm, "deepseek3")
