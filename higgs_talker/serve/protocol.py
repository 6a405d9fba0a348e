"""Bodies of the speech server's requests and responses, in OpenAI's shapes where OpenAI has one.

``SpeechRequest`` takes OpenAI's ``/v1/audio/speech`` fields and the ones vllm-omni's Higgs endpoint adds
(``ref_audio``, ``ref_text``, ``max_new_tokens``, ``seed``, sampling, ``stream``), and refuses any other field
by name. Every error is ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``, ``code`` a string
or null as OpenAI's (the status is the response's).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_SEED = 2**63 - 1


class VoiceId(BaseModel):
    """OpenAI's custom-voice object: ``{"id": "name"}``."""

    model_config = ConfigDict(extra="forbid")
    id: str


class SpeechRequest(BaseModel):
    """``POST /v1/audio/speech``. Strict types, as OpenAI's schema gives them: ``"stream": "yes"``, ``"seed": "7"``
    or ``"speed": true`` are refused, not converted (an integer is still a number); ``null`` is the default."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input: str = Field(description="the text to speak")
    model: str | None = Field(None, description="the served model's name (GET /v1/models); None: that one")
    voice: str | VoiceId | None = Field(None, description="an uploaded voice's name, or 'default' (no reference)")
    instructions: str | None = Field(None, description="OpenAI's voice instructions: not supported, must be empty")
    response_format: str = Field(
        "wav", description="wav, pcm (16-bit mono little-endian at 24 kHz), mp3, opus (in Ogg), aac (ADTS) or flac"
    )
    speed: float = Field(1.0, description="only 1.0")
    stream_format: Literal["audio", "sse"] | None = Field(
        None, description="audio: the bytes as they are made; sse: speech.audio.delta / speech.audio.done events"
    )
    stream: bool | None = Field(
        None,
        description="vllm-omni's switch: false, the whole file at once (exact WAV sizes); true without stream_format, "
        "events (sse); default: the bytes streamed",
    )
    ref_audio: str | None = Field(None, description="a reference recording as a data: URL (base64 WAV), 1-30 s")
    ref_text: str | None = Field(None, description="what ref_audio says")
    max_new_tokens: int | None = Field(None, ge=1, description="most audio frames (25 a second) of each part")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    extra_params: dict[str, Any] | None = Field(
        None, description="vllm-omni's way to give temperature, top_p and top_k (only those keys here)"
    )

    @field_validator("response_format", "speed", mode="before")
    @classmethod
    def _null_is_the_default(cls, value, info):
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_shape(cls, value):
        """One error naming ``voice`` for any other shape (not one per member of the union, as ``voice.str``)."""
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, dict) and value.keys() == {"id"} and isinstance(value["id"], str):  # no other key
            return value
        raise ValueError('voice must be a voice name or an object {"id": name}')


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    # OpenAI's: a string naming the error, or null; not the HTTP status (vLLM's int breaks typed clients, such as
    # OpenAI's Java SDK, which raises on reading a number there and so loses the message)
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class SpeechUsage(BaseModel):
    input_tokens: int  # prompt tokens, over all parts
    output_tokens: int  # audio frames generated
    total_tokens: int


class SpeechAudioDelta(BaseModel):
    type: Literal["speech.audio.delta"] = "speech.audio.delta"
    audio: str  # base64 of the next bytes of the audio (for wav, the first delta starts with the header)


class SpeechAudioDone(BaseModel):
    type: Literal["speech.audio.done"] = "speech.audio.done"
    usage: SpeechUsage


class SpeechError(BaseModel):
    """Sent in place of ``speech.audio.done`` when a streamed request fails after its first byte."""

    type: Literal["error"] = "error"
    error: ErrorInfo


class VoiceCard(BaseModel):
    object: Literal["voice"] = "voice"
    name: str
    ref_text: str | None = None
    frames: int  # reference codes [frames, 8]; 0 for the default voice
    seconds: float
    created_at: int


class VoiceList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VoiceCard]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "higgs-talker"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class APIError(Exception):
    """A request the server refuses: ``status`` with ``ErrorResponse`` naming ``param`` (the field at fault) and,
    where OpenAI has one, its ``code``."""

    def __init__(
        self, status: int, message: str, param: str | None = None, type: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code or _ERROR_CODES.get(status)
        self.type = type or ("timeout_error" if status == 408 else "invalid_request_error" if status < 500
                             else "server_error")  # fmt: skip

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


# OpenAI's errors: every refused request is an invalid_request_error (a timeout is ours: sse clients tell it apart),
# the code says more
_ERROR_CODES = {404: "not_found", 409: "conflict", 413: "request_too_large"}
