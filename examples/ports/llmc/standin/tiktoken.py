"""A stand-in for ``tiktoken`` where it is not installed (the CPU image): llm.c's train_gpt2.py
imports it for its tokenizer file and for sampling, neither of which the port comparison runs
(``--write_tensors=0 --sample_every=0``). Only what the script touches at start-up is here."""


class _Encoding:
    eot_token = 50256

    def decode(self, tokens):
        return " ".join(str(t) for t in tokens)


def get_encoding(name):
    return _Encoding()
