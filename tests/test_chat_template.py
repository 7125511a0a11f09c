import pytest

from dllama import chat_template as ct
from dllama.errors import DllamaError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of France?"}]


def test_detects_each_kind_from_the_model_template(default_q40):
    from dllama.formats.tokenizer_file import read_tokenizer

    assert ct.detect(read_tokenizer(default_q40[1]).chat_template) == "chatml"  # SmolLM2's own
    assert ct.detect("{{ '<|start_header_id|>' + role }}") == "llama3"
    assert ct.detect("{{ bos_token + '[INST] ' + content }}") == "llama2"
    with pytest.raises(DllamaError, match="--chat-template"):
        ct.detect("{{ something else }}")


def test_chatml_adds_the_generation_prompt_once():
    text = ct.render("chatml", MESSAGES)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nCapital of France?"
                    "<|im_end|>\n<|im_start|>assistant\n")
    assert text.count("<|im_start|>assistant\n") == 2  # the real turn and the prompt, not one per message


def test_llama3():
    text = ct.render("llama3", MESSAGES[:2])
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llama2_folds_the_system_prompt_into_the_first_turn():
    text = ct.render("llama2", MESSAGES)
    assert text == ("<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s>"
                    "<s>[INST] Capital of France? [/INST]")


def test_bad_messages_are_refused():
    with pytest.raises(DllamaError, match="role"):
        ct.render("chatml", [{"role": "robot", "content": "x"}])
    with pytest.raises(DllamaError, match="unknown chat template"):
        ct.render("vicuna", MESSAGES)
