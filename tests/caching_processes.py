"""One process of a multi-process run's caching (tests/test_concurrent_caching.py starts two with
torch.distributed.run on the CPU): DiffusionTask._fill_caches with a stand-in family over the
images in argv[1]/img, then one JSON line of what this process encoded and printed."""

import json
import os
import sys
from pathlib import Path

from accelerate import Accelerator

from library.data.prompts import SamplePrompt
from tests.test_cache_freshness import fill_caches, stand_in_family

if __name__ == "__main__":
    accelerator = Accelerator(cpu=True)
    loads = []
    family = stand_in_family(loads)
    _, printed = fill_caches(Path(sys.argv[1]), family, [SamplePrompt("a dog")],
                             accelerator=accelerator)
    loaded = list(loads)
    encoder = family.load_text_encoder("bf16", None).__self__  # (the CountingEncoder behind both)
    line = json.dumps({"process": accelerator.process_index, "loads": loaded, "images": encoder.images,
                       "captions": sorted(encoder.captions), "printed": printed})
    os.write(1, (line + "\n").encode())  # one write (under PIPE_BUF): print's two let the processes' lines interleave
    # both past their last collective, then the process group torn down before exit, as train_lora does
    # (end_training): left to the interpreter's teardown, gloo aborted one process in a CI run (SIGABRT)
    accelerator.wait_for_everyone()
    accelerator.end_training()
