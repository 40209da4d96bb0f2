"""Generate the offline tokenizer and dataset the CPU recipes train on (no hub download).

    python assets/make_tiny.py     # writes assets/tiny/{tokenizer.json,tokenizer_config.json}
                                   # and assets/tiny/c4_tiny/train.jsonl

The text is synthetic English from a small grammar (seeded, so the output is reproducible): it
has enough structure for the loss of a tiny model to fall within a few steps. The tokenizer is
a byte-level BPE with 2048 entries, the `debugmodel` vocabulary size. Rows have the c4 schema
({"text": ...}), so TorchTitan's "c4_test" loader reads them via [training] dataset_path.
"""

import json
import random
from pathlib import Path

from tokenizers import decoders, models, pre_tokenizers, trainers, Tokenizer

OUT = Path(__file__).resolve().parent / "tiny"
VOCAB_SIZE = 2048
NUM_DOCS = 600
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

NOUNS = "cat dog bird river tree engine city garden student teacher ship cloud market road door window".split()
ADJS = "small large quiet bright old young green cold warm busy empty heavy".split()
VERBS = "sees follows builds finds carries opens watches paints crosses visits".split()
ADVS = "slowly quickly often rarely carefully gladly".split()
PLACES = "near the hill|by the sea|in the park|under the bridge|at the station|behind the house".split("|")


def sentence(rng: random.Random) -> str:
    a, b = rng.sample(NOUNS, 2)
    words = [
        "the", rng.choice(ADJS), a, rng.choice(VERBS), "the", rng.choice(ADJS), b,
        rng.choice(ADVS), rng.choice(PLACES),
    ]
    return " ".join(words).capitalize() + "."


def document(rng: random.Random) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(8, 40)))


def main() -> None:
    rng = random.Random(0)
    docs = [document(rng) for _ in range(NUM_DOCS)]
    (OUT / "c4_tiny").mkdir(parents=True, exist_ok=True)
    with open(OUT / "c4_tiny" / "train.jsonl", "w") as f:
        for text in docs:
            f.write(json.dumps({"text": text}) + "\n")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(docs, trainer)
    tokenizer.save(str(OUT / "tokenizer.json"))
    with open(OUT / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False}, f, indent=2)
    print(f"wrote {OUT} (vocab {tokenizer.get_vocab_size()}, {len(docs)} documents)")


if __name__ == "__main__":
    main()
