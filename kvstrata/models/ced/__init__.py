"""The source design's causal encoder-decoder on a pretrained model: half-depth prefill, the
decoder's K/V projected from the encoder's last hidden state (`model`), fitted by least squares
(`fit`), saved as a model directory `kvstrata.models.load` takes back (`store`)."""
