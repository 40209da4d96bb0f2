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

from make_real import train_tokenizer  # the same byte-level BPE and tokenizer_config.json
from tokenizers import Tokenizer

OUT = Path(__file__).resolve().parent / "tiny"
VOCAB_SIZE = 2048
NUM_DOCS = 600

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

    train_tokenizer(docs, OUT, VOCAB_SIZE)
    vocab = Tokenizer.from_file(str(OUT / "tokenizer.json")).get_vocab_size()  # what the corpus filled, under VOCAB_SIZE
    print(f"wrote {OUT} (vocab {vocab}, {len(docs)} documents)")


if __name__ == "__main__":
    main()
