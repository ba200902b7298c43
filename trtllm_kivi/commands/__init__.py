"""Subcommands of the trtllm-kivi CLI (see trtllm_kivi/cli.py)."""
