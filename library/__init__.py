import logging

# bitsandbytes' CPU backend tries to fetch an optional 4-bit kernel from a model hub when it is
# imported (diffusers imports it) and logs a warning when it cannot; we use no 4-bit kernels, and
# that stray line would break "bad input prints one clear line".
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
