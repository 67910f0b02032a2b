import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/vllm-setup.sh builds build/vllm-venv)")
pytest.importorskip("cascade", reason="the cascade module is not installed")
