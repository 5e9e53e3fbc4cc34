"The training chapter's model through the engine (a later chapter): `LLM()` loads the shipped folder and completes code."
from nanoserve.engine import LLM, SamplingParams
from nanoserve.tokenizer import shipped_model_dir


def test_llm_loads_the_shipped_model_when_none_is_named_and_completes_code_prompts():
    llm = LLM()
    assert llm.model_dir == shipped_model_dir()
    prompts = ["def fibonacci(n):\n", "import os\n\ndef read_lines(path):\n", "class Stack:\n    def __init__(self):\n",
               "for i in range(10):\n"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0))
    assert len(outs) == len(prompts)
    for p, o in zip(prompts, outs):
        print("-" * 60); print(p + o.text)
