#!/usr/bin/env python3
"""Record what transformers computes for the first batch of a fine-tuning run, for
tests/finetune.rs: for each model fixture, a few sentence pairs, their ids as transformers'
tokenizers make them (MarianTokenizer with text_target for OPUS-MT, the tokenizer.json
otherwise), and the mean cross-entropy over the target tokens of the model in eval mode (no
dropout, no label smoothing). `nmt train --init FIXTURE --dropout 0 --label-smoothing 0` must
log the same first loss: proof that weights, tokenization and label layout carried over.

    python3 scripts/gen-finetune-fixture.py      # writes tests/fixtures/{nmt-toy,opus-tiny}/finetune.json
    python3 scripts/gen-finetune-fixture.py --finetuned NMT_BINARY
        # fine-tunes tests/fixtures/opus-tiny with `nmt train --init` (FINETUNE_FLAGS), keeps the
        # checkpoint's weights and config in tests/fixtures/opus-tiny-finetuned, loads it with
        # MarianTokenizer and MarianMTModel.from_pretrained, converts it with
        # ct2-transformers-converter, and records both peers' greedy and beam-4 translations
        # there in finetuned.json
    python3 scripts/gen-finetune-fixture.py --decode DIR FILE [--beam N]
        # loads a checkpoint nmt fine-tuned (MarianTokenizer or tokenizer.json, and
        # MarianMTModel.from_pretrained) and prints its translations of FILE, one per line, to
        # compare with `nmt translate --model DIR --beam N --max-len-a 0 --max-len-b 64`

Needs torch, transformers and sentencepiece (pip install torch transformers sentencepiece), and
ctranslate2 for --finetuned.
"""
import json, os

import torch
import transformers
from transformers import MarianMTModel, MarianTokenizer, PreTrainedTokenizerFast

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")

PAIRS = {
    "nmt-toy": [("1 2 3", "one two three"), ("4 0 9 9", "four zero nine nine"),
                ("7 7 5 1 2 6", "seven seven five one two six")],
    "opus-tiny": [("Zwei junge Männer spielen Fußball.", "Two young men play football."),
                  ("Ein Hund läuft über die Straße.", "A dog runs across the street."),
                  ("Eine Frau trägt einen Hut.", "A woman wears a hat.")],
}


def tokenizer_of(path):
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"),
                                      eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
        enc = lambda texts, target: [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                                     for t in texts]
        return tok, enc
    tok = MarianTokenizer.from_pretrained(path)
    enc = lambda texts, target: (tok(text_target=texts) if target else tok(texts))["input_ids"]
    return tok, enc


def generate(path, lines, beam):
    model = MarianMTModel.from_pretrained(path).eval()
    tok, _ = tokenizer_of(path)
    batch = tok(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, num_beams=beam, max_new_tokens=64, do_sample=False)
    return tok.batch_decode(out, skip_special_tokens=True)


def decode(path, sources, beam):
    lines = [l.rstrip("\n") for l in open(sources, encoding="utf-8")]
    for text in generate(path, lines, beam):
        print(text)


# The fine-tuning of tests/finetune.rs's parity check: long enough for the tiny model to end
# its outputs with </s>.
FINETUNE_FLAGS = ["--max-steps", "300", "--max-tokens", "256", "--lr", "0.003", "--warmup", "10",
                  "--label-smoothing", "0", "--dropout", "0"]


def finetuned(nmt):
    """The OPUS-MT fixture fine-tuned by nmt (weights and config kept in
    tests/fixtures/opus-tiny-finetuned, the SentencePiece files being opus-tiny's), decoded by
    transformers and by CTranslate2."""
    import shutil, subprocess, sys, tempfile
    import ctranslate2
    pairs = PAIRS["opus-tiny"]
    opus = os.path.join(FIX, "opus-tiny")
    out_dir = os.path.join(FIX, "opus-tiny-finetuned")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        src, tgt = os.path.join(work, "t.de"), os.path.join(work, "t.en")
        for path, side in ((src, 0), (tgt, 1)):
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(pairs[i % len(pairs)][side] + "\n" for i in range(60))
        run = os.path.join(work, "run")
        subprocess.run([nmt, "train", "--init", opus, "--src", src, "--tgt", tgt,
                        "--valid-src", src, "--valid-tgt", tgt, "--out", run] + FINETUNE_FLAGS,
                       check=True, stderr=subprocess.DEVNULL)
        last = os.path.join(run, "last")
        for f in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(last, f), os.path.join(out_dir, f))
        lines = [p[0] for p in pairs]
        out = {"transformers": transformers.__version__, "ctranslate2": ctranslate2.__version__,
               "loaded_with": "MarianTokenizer, MarianMTModel.from_pretrained, ct2-transformers-converter",
               "finetune_flags": FINETUNE_FLAGS, "sources": lines}
        ct2 = os.path.join(work, "ct2")
        converter = os.path.join(os.path.dirname(sys.executable), "ct2-transformers-converter")
        subprocess.run([converter, "--model", last, "--output_dir", ct2],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tok = MarianTokenizer.from_pretrained(last)
        translator = ctranslate2.Translator(ct2, device="cpu")
        for beam in (1, 4):
            out[f"beam{beam}"] = generate(last, lines, beam)
            print(f"transformers, beam {beam}: {out[f'beam{beam}']}")
        # CTranslate2 loads the converted checkpoint; its greedy search is compared (its beam
        # search normalises lengths its own way).
        tokens = [tok.convert_ids_to_tokens(tok.encode(l)) for l in lines]
        results = translator.translate_batch(tokens, beam_size=1, max_decoding_length=64)
        out["ct2_beam1"] = [tok.decode(tok.convert_tokens_to_ids(r.hypotheses[0]), skip_special_tokens=True)
                            for r in results]
        print(f"ctranslate2, greedy: {out['ct2_beam1']}")
    with open(os.path.join(out_dir, "finetuned.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)


def main():
    for name, pairs in PAIRS.items():
        path = os.path.join(FIX, name)
        model = MarianMTModel.from_pretrained(path).eval()
        tok, enc = tokenizer_of(path)
        pad, start = model.config.pad_token_id, model.config.decoder_start_token_id
        src = enc([p[0] for p in pairs], False)
        tgt = enc([p[1] for p in pairs], True)
        ws, wt = max(map(len, src)), max(map(len, tgt))
        input_ids = torch.tensor([s + [pad] * (ws - len(s)) for s in src])
        labels = torch.tensor([t + [-100] * (wt - len(t)) for t in tgt])
        dec_in = torch.tensor([[start] + t[:-1] + [pad] * (wt - len(t)) for t in tgt])
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=(input_ids != pad),
                           decoder_input_ids=dec_in).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 labels.reshape(-1), ignore_index=-100)
        out = {"transformers": transformers.__version__, "torch": torch.__version__,
               "pairs": pairs, "src_ids": src, "tgt_ids": tgt, "loss": loss.item()}
        with open(os.path.join(path, "finetune.json"), "w") as f:
            json.dump(out, f, indent=1, ensure_ascii=False)
        print(name, loss.item())


if __name__ == "__main__":
    import sys
    if len(sys.argv) > 1 and sys.argv[1] == "--finetuned":
        finetuned(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "--decode":
        beam = int(sys.argv[sys.argv.index("--beam") + 1]) if "--beam" in sys.argv else 1
        decode(sys.argv[2], sys.argv[3], beam)
    else:
        main()
