#!/bin/sh
# --torch-device: CUDA's softmax backward makes `grad * output` (SoftMax.cu), the CPU's does not.
# llama-2-7b, eager, 1 x 4096 on 8 GPUs peaks at layer 31's softmax backward, so the tensors at
# the peak differ by exactly that product: [1, 32, 4096, 4096] in fp32, 2,147,483,648 bytes; the
# config says which device was planned.
#   torch_device_product.sh PLAN
set -u
fail() { echo "FAIL: $*"; exit 1; }
for device in cuda cpu; do
  "$1" --model llama-2-7b --gpus 8 --seq-len 4096 --attention eager --torch-device "$device" --json > "/tmp/torch_device_$$_$device.json" ||
    fail "fsdp-plan --torch-device $device: exit $?"
done
python3 - "/tmp/torch_device_$$_cuda.json" "/tmp/torch_device_$$_cpu.json" <<'PY'
import json, sys
cuda, cpu = (json.load(open(p)) for p in sys.argv[1:3])
for doc, name in ((cuda, "cuda"), (cpu, "cpu")):
    if doc["config"]["torch_device"] != name:
        sys.exit(f"FAIL: config.torch_device {doc['config']['torch_device']!r}, expected {name!r}")
gap = cuda["memory"]["per_gpu"]["allocated_peak_bytes"] - cpu["memory"]["per_gpu"]["allocated_peak_bytes"]
print(f"tensors at the peak, cuda - cpu: {gap} bytes ({cuda['memory']['per_gpu']['allocated_peak_phase']})")
if gap != 4 * 32 * 4096 * 4096:
    sys.exit(f"FAIL: expected 2147483648 (CUDA's grad * output)")
PY
status=$?
rm -f /tmp/torch_device_$$_cuda.json /tmp/torch_device_$$_cpu.json
exit $status
