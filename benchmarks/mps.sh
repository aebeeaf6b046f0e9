# Sourced by the GPU scripts: CUDA's Multi-Process Service for runs trained side by side. Small models leave the
# GPU idle between launches; without MPS the processes' kernels take turns on it instead of running together.
#   mps_start FILE   start the control daemon (FILE says whether it started; without it the jobs time-slice)
#   mps_stop         stop it, if mps_start started it
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/k3-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/k3-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then echo "MPS on" > "$1"; else
    echo "MPS did not start; the jobs time-slice the GPU" > "$1"; unset CUDA_MPS_PIPE_DIRECTORY; fi
}
mps_stop() {
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
