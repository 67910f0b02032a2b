"""cascade as vLLM's CPU attention backend (loaded through the vllm.general_plugins entry point `cascade`)."""

from vllm.logger import init_logger

# Under vLLM's logger (configured by importing vllm.logger), so that its handlers and VLLM_LOGGING_LEVEL apply.
logger = init_logger("vllm.cascade_vllm")

BACKEND_PATH = "cascade_vllm.backend.CascadeAttentionBackend"


def register() -> None:
    """Points CPU_ATTN, the backend vLLM's CPU platform selects, at cascade's. Safe to call more than once."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if AttentionBackendEnum.CPU_ATTN.get_path() != BACKEND_PATH:
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
        logger.info("cascade_vllm: CPU_ATTN runs %s", BACKEND_PATH)
