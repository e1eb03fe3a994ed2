"""The model a Triton repository serves, read back from its config.pbtxt: `dgpipe serve` takes the served
name (what /v1/models lists, what requests, health pings and the drain address) and the prompt cap of its
OpenAI frontend from here, never from a default, so `dgpipe package --name NAME` serves under NAME.
Light on purpose (no torch): the supervisor reads it before it starts anything."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import DgpipeError
from pipeline.limits import Limits


@dataclass(frozen=True)
class ServedModel:
    """The one model a repository serves: its name (what clients, health pings and drains address) and its
    config.pbtxt parameters (the limits `package` wrote, under their own names)."""

    name: str
    parameters: dict[str, str]

    @property
    def limits(self) -> Limits:
        """The limits written into the parameters (defaults for any not written, e.g. max_context)."""
        where = f"model '{self.name}' config.pbtxt parameters"
        written = {k: v for k, v in self.parameters.items() if k in Limits.model_fields}
        try:
            return Limits.from_record({k: int(v) for k, v in written.items()}, where)
        except ValueError as e:
            raise DgpipeError(f"{where}: a limit is not an integer ({written})") from e


def read_repository(repo: Path) -> ServedModel:
    """The model a repository serves, read from its one `<dir>/config.pbtxt` with Triton's own schema, as
    `package` writes it. A repository with no model or several is refused: `dgpipe serve` serves one."""
    from google.protobuf import text_format
    from google.protobuf.message import DecodeError
    from tritonclient.grpc import model_config_pb2 as mc

    configs = sorted(Path(repo).glob("*/config.pbtxt"))
    if len(configs) != 1:
        found = ", ".join(c.parent.name for c in configs) or "none"
        raise DgpipeError(
            f"{repo}: a dgpipe model repository holds exactly one model (<name>/config.pbtxt); found {found}",
            "create one with `dgpipe package --output DIR [--name NAME]`",
        )
    try:
        cfg = text_format.Parse(configs[0].read_text(), mc.ModelConfig())
    except (OSError, UnicodeDecodeError, text_format.ParseError, DecodeError) as e:
        raise DgpipeError(f"{configs[0]}: not a readable Triton model config ({e})") from e
    # Triton serves a model under its directory's name; a config naming another one is refused at load
    name = cfg.name or configs[0].parent.name
    if name != configs[0].parent.name:
        raise DgpipeError(
            f"{configs[0]}: names the model '{name}' but lies in '{configs[0].parent.name}/'",
            "repackage it with `dgpipe package --name NAME`",
        )
    return ServedModel(name, {k: v.string_value for k, v in cfg.parameters.items()})


def from_triton(grpc_url: str, name: str, timeout: float = 5.0) -> ServedModel | None:
    """The served model `name` as a running Triton reports it (its config, parameters included), for a
    frontend that has no repository of its own (the pod's OpenAI sidecar). Triton's model-config API stays
    open under dgpipe's lock-down (its repository index does not, so the name must be given). None while
    Triton is unreachable or has not loaded the model yet."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    try:
        client = grpcclient.InferenceServerClient(grpc_url.removeprefix("grpc://"))
    except InferenceServerException:
        return None
    try:
        cfg = client.get_model_config(name, as_json=True, client_timeout=timeout)["config"]
    except InferenceServerException:
        return None
    finally:
        client.close()
    return ServedModel(name, {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()})
