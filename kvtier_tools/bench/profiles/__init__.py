"""Profiles of one part at a time, run by the GPU scripts (scripts/gpu_bench.sh,
scripts/gpu2_bench.sh, scripts/pd_gpu_bench.sh): the lossy KV codecs' cost and quality, the PD
sender's host time, the PD round trip, the decoder's IPC writes."""
