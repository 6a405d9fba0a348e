"""``higgs-talker serve``: an OpenAI-compatible speech server on the direct engine (one GPU, or CPU).

- ``protocol``: the request and response bodies (pydantic) and the one JSON error shape.
- ``serving``: ``SpeechServing``, what the routes call: a request checked and turned into audio bytes, streamed
  from a worker thread per request while the engine's driver thread batches everyone's steps.
- ``voices``: uploaded reference voices, encoded once and kept as codes.
- ``encoding``: PCM, WAV (with a streaming header) and server-sent events.
- ``app``: the FastAPI routes, the body-size limit, uvicorn and a clean shutdown; ``options``: the CLI flags.

Needs the ``serve`` extra (FastAPI, uvicorn, python-multipart); ``import higgs_talker`` never imports this
package, and importing ``higgs_talker.serve`` or ``higgs_talker.serve.options`` imports none of them either.
"""
