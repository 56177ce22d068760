#!/usr/bin/env python3
"""Generate the model-parity fixtures under tests/fixtures/ with transformers.

    python3 scripts/gen-model-fixtures.py            # HF -> nmt: tiny random Marian + logits
    python3 scripts/gen-model-fixtures.py --check-nmt DIR
        # nmt -> HF: load a checkpoint nmt wrote with MarianMTModel.from_pretrained, compare its
        # logits with the ones nmt recorded in DIR/logits.json, and record the result.

Needs torch and transformers (pip install torch transformers).
"""
import argparse, json, os, sys

import torch
import transformers
from transformers import MarianConfig, MarianMTModel

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")


def tiny(normalize_before=False, activation="relu"):
    return MarianConfig(vocab_size=61, decoder_vocab_size=61, d_model=16, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
                        decoder_ffn_dim=32, max_position_embeddings=32, activation_function=activation,
                        scale_embedding=True, pad_token_id=60, eos_token_id=0, decoder_start_token_id=60,
                        forced_eos_token_id=0, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
                        dropout=0.1)


INPUT = {
    # Two source sentences, the second padded; decoder inputs start with the pad id (Marian).
    "src": [[5, 17, 33, 8, 42, 0], [9, 21, 0, 60, 60, 60]],
    "tgt_in": [[60, 7, 13, 29, 0], [60, 44, 3, 60, 60]],
}


def logits_of(model):
    src = torch.tensor(INPUT["src"]); tgt = torch.tensor(INPUT["tgt_in"])
    with torch.no_grad():
        out = model(input_ids=src, attention_mask=(src != 60), decoder_input_ids=tgt,
                    decoder_attention_mask=(tgt != 60) | (torch.arange(tgt.shape[1]) == 0)).logits
    return out


def hf_to_nmt():
    for name, act in [("marian-tiny", "relu"), ("marian-tiny-gelu", "gelu")]:
        torch.manual_seed(0)
        model = MarianMTModel(tiny(activation=act)).eval()
        with torch.no_grad():  # non-zero biases so that every tensor matters
            model.final_logits_bias.normal_(0, 0.5)
            for n, p in model.named_parameters():
                if n.endswith(".bias"):
                    p.normal_(0, 0.1)
        out = os.path.join(FIX, name)
        model.save_pretrained(out)
        with open(os.path.join(out, "logits.json"), "w") as f:
            json.dump({"transformers": transformers.__version__, **INPUT,
                       "logits": logits_of(model).tolist()}, f)
        print("wrote", out)


def nmt_to_hf(path):
    model = MarianMTModel.from_pretrained(path).eval()
    want = json.load(open(os.path.join(path, "logits.json")))
    got = logits_of(model)
    ref = torch.tensor(want["logits"])
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    result = {"transformers": transformers.__version__, "checkpoint": os.path.basename(os.path.normpath(path)),
              "loaded": True, "max_rel_diff": rel, "ok": rel < 1e-4}
    with open(os.path.join(FIX, "nmt-to-hf.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-nmt", metavar="DIR")
    a = ap.parse_args()
    nmt_to_hf(a.check_nmt) if a.check_nmt else hf_to_nmt()
