"""Run spec requests through vllm-omni's offline ``Omni`` (both stages) and save each request's audio.

Run as a script (``Omni`` starts its own stage processes): ``python omni_run.py CKPT YAML SPEC_JSON OUT_DIR
[BATCH_JSON]``.
SPEC_JSON is a list of ``{"key", "text", "max_tokens", "temperature", "top_k", "top_p", "seed", "ref_codes"}`` (a
missing sampling key keeps the deploy profile's; ``ref_codes``, aligned codes [T, C], makes the request a voice
clone, sent as vllm-omni 0.26's speech endpoint sends one: -100 placeholders in the prompt, the delayed rows in
``additional_information`` without positions); each request runs alone, one after another. Each audio goes to
``OUT_DIR/<key>.pt`` (float32 [S]); prints ``RESULT:`` and ``{"results": [{"key", "samples", "outputs",
"request_id"}]}``.
BATCH_JSON ``{"keys": [...], "max_tokens": N}`` then sends those requests in one call, greedy with one length
(one sampling for all: the offline API takes one per stage), so Stage 0 batches them; their audio goes to
``OUT_DIR/batched_<key>.pt`` and their result rows carry ``"batched": true``; with ``"alone": false`` in it the
requests are not also run one by one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(ckpt: str, yaml_path: str, spec: list[dict], out_dir: Path, batch: dict | None = None) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import torch
    from bench_omni import audio_of, stage_params
    from vllm_omni import Omni

    omni = Omni(model=ckpt, deploy_config=yaml_path, stage_init_timeout=600)
    results = []
    try:
        for r in spec if (batch or {}).get("alone", True) else []:
            params = stage_params(omni, r.get("temperature"), r.get("seed"), None, stream=False)
            params[0].max_tokens = r["max_tokens"]
            for key in ("top_k", "top_p"):
                if key in r:
                    setattr(params[0], key, r[key])
            outs = list(omni.generate([omni_prompt(ckpt, r)], params, use_tqdm=False))
            chunks = [a for a in (audio_of(o) for o in outs) if a is not None]
            audio = chunks[-1] if chunks else torch.zeros(0)  # FINAL_ONLY: the last output holds the whole audio
            torch.save(audio, out_dir / f"{r['key']}.pt")
            results.append({"key": r["key"], "samples": int(audio.numel()), "outputs": len(outs),
                            "request_id": request_id(outs)})  # fmt: skip
        if batch:
            together = [r for r in spec if r["key"] in batch["keys"]]
            params = stage_params(omni, 0.0, None, None, stream=False)
            params[0].max_tokens = batch["max_tokens"]
            outs = list(omni.generate([omni_prompt(ckpt, r) for r in together], params, use_tqdm=False))
            for i, r in enumerate(together):  # request ids are "<prompt index>_<uuid>"
                mine = [o for o in outs if str(o.request_id).split("_")[0] == str(i)]
                chunks = [a for a in (audio_of(o) for o in mine) if a is not None]
                audio = chunks[-1] if chunks else torch.zeros(0)
                torch.save(audio, out_dir / f"batched_{r['key']}.pt")
                results.append({"key": r["key"], "batched": True, "samples": int(audio.numel()), "outputs": len(mine),
                                "request_id": request_id(mine)})  # fmt: skip
    finally:
        omni.close()
    return {"results": results}


def request_id(outputs: list) -> str | None:
    """The one request id of a request's outputs (the Stage-0 score probe files its record under it)."""
    ids = {str(o.request_id) for o in outputs}
    if len(ids) > 1:
        raise RuntimeError(f"one request's outputs carry several request ids: {sorted(ids)}")
    return ids.pop() if ids else None


def omni_prompt(ckpt: str, r: dict) -> dict:
    """The offline prompt of spec request ``r``: its token ids, and for a voice clone the placeholders, the rows
    and their ``cache_salt`` (``Prompt.vllm_prompt``: the -100 ids alone would let one voice hit another's blocks)."""
    import torch
    from bench_omni import checkpoint_tokenizer

    from higgs_talker.heads.spans import PLACEHOLDER

    cfg, tokenizer = checkpoint_tokenizer(ckpt)
    codes = torch.tensor(r["ref_codes"]) if r.get("ref_codes") is not None else None
    prompt = tokenizer.build(r["text"], codes, None, cfg)
    if prompt.audio_codes is None:
        return prompt.vllm_prompt()
    ids = prompt.input_ids.clone()
    ids[prompt.audio_positions] = PLACEHOLDER
    rows = prompt.audio_codes.long()
    info = {"audio_input_ids": rows, "audio_input_ids_mask": torch.ones(rows.shape[0], dtype=torch.bool)}
    return prompt.vllm_prompt() | {"prompt_token_ids": ids.tolist(), "additional_information": info}


if __name__ == "__main__":
    batch = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
    out = main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4]), batch)
    print("RESULT:" + json.dumps(out))
