"""Images: probe, decode, BAGEL's resize rule, tensors, patchify and position ids.

mmidx stores images as their encoded bytes and probes width, height, format and mode at build time,
so the index can compute every image's token count without decoding it (``num_image_tokens``).
At read time an image is decoded, converted to RGB, resized and normalised exactly as BAGEL's
``pil_img2rgb`` and ``ImageTransform`` do (``data/data_utils.py``, ``data/transforms.py`` at
commit 056b5fd), then cut into ViT patches with BAGEL's position ids. Nothing here needs
torchvision: its only BAGEL-relevant behaviour on PIL images is PIL's bicubic resize, ``/255`` in
float32 and a float32 subtract/divide, which this module reproduces bit for bit: one Cython pass
(``csrc/_pixels.pyx``) resizes the decoded pixels with Pillow's own fixed-point bicubic arithmetic
and writes normalised float32 straight into the batch buffers.

BAGEL quirks reproduced on purpose (a trainer that was tuned on BAGEL sees the same pixels):

* ``to_rgb`` composites on white only ``RGBA`` images and images whose ``info`` carries a
  ``transparency`` entry (``P``/``L``/``RGB`` with a tRNS chunk, GIF). ``LA`` and ``PA`` images
  keep alpha as a channel, not in ``info``, so their alpha is dropped, not composited.
* EXIF orientation is ignored: sizes are the stored ones, as BAGEL decodes them.
* The resize rule rounds with Python's ``round`` (half to even), so a 520² image becomes 512², not
  528², with stride 16; the ``max_pixels`` ratio is applied to each side linearly (not its square
  root), so an image over the pixel budget shrinks by the budget ratio per side, and may end below
  ``min_size`` (980² with the vlm preset and ``img_num=12`` becomes 168², not about 409²).
* ``position_ids_interpolate`` decides ties between a patch coordinate and a grid boundary by
  the float32 values ``torch.arange`` produces, not by exact arithmetic; it calls the same torch
  operations as BAGEL so that the ids are the same on the same machine.
"""
