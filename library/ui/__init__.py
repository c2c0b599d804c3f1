"""The local web UI (tools/webui.py): a SQLite job queue run by train_lora.py subprocesses, and the
gradio pages that create, watch, stop and resume jobs. Nothing here imports torch: training, config
checks, planning and the LoRA tools run in their own processes."""
