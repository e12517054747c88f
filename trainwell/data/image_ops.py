"""The per-image operations of `trainwell.data.images`: windowed decoding, the crops, the cheap
structural check of encoded images, and `Transform` (decode and augment one image).

Example:
>>> import tensorflow as tf
>>> bool(valid_image(tf.io.encode_png(tf.zeros([2, 2, 3], tf.uint8))))
True
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["Transform", "center_window", "crop_array", "decode_window", "inception_window", "valid_image"]


def decode_window(image_bytes, channels: int, window_fn):
    """Decodes only `window_fn(shape)` of a JPEG; other formats are decoded, then cropped."""
    def jpeg():
        y, x, h, w = window_fn(tf.image.extract_jpeg_shape(image_bytes))
        return tf.image.decode_and_crop_jpeg(image_bytes, tf.stack([y, x, h, w]), channels=channels)

    def other():
        image = tf.io.decode_image(image_bytes, channels=channels, expand_animations=False)
        y, x, h, w = window_fn(tf.shape(image))
        return tf.slice(image, tf.stack([y, x, 0]), tf.stack([h, w, channels]))

    image = tf.cond(tf.io.is_jpeg(image_bytes), jpeg, other)
    image.set_shape([None, None, channels])
    return image


def crop_array(image, window_fn):
    y, x, h, w = window_fn(tf.shape(image))
    return tf.slice(image, tf.stack([y, x, 0]), tf.stack([h, w, tf.shape(image)[2]]))


def inception_window(seed):
    def fn(shape):
        begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
            tf.cast(shape, tf.int32),
            bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
            seed=seed,
            min_object_covered=0.0,
            aspect_ratio_range=(3.0 / 4.0, 4.0 / 3.0),
            area_range=(0.08, 1.0),
            max_attempts=10,
            use_image_if_no_bounding_boxes=True,
        )
        return begin[0], begin[1], size[0], size[1]

    return fn


def center_window(fraction: float):
    def fn(shape):
        h, w = tf.cast(shape[0], tf.int32), tf.cast(shape[1], tf.int32)
        side = tf.maximum(1, tf.cast(tf.round(fraction * tf.cast(tf.minimum(h, w), tf.float32)), tf.int32))
        return (h - side + 1) // 2, (w - side + 1) // 2, side, side

    return fn


def _tail_contains(image_bytes, seq: bytes, window: int = 1024):
    n = tf.strings.length(image_bytes)
    start = tf.maximum(n - window, 0)
    tail = tf.io.decode_raw(tf.strings.substr(image_bytes, start, n - start), tf.uint8)
    m = tf.maximum(tf.shape(tail)[0] - len(seq) + 1, 0)
    hit = tf.ones([m], tf.bool)
    for i, c in enumerate(seq):
        hit = tf.logical_and(hit, tf.equal(tail[i : i + m], c))
    return tf.reduce_any(hit)


def valid_image(image_bytes):
    """Cheap structural check, in-graph: a known image signature and, for JPEG and PNG,
    an end marker (EOI `FFD9`, `IEND`) in the last KiB. Catches empty, non-image
    (HTML error pages, text), garbled-header and truncated files without decoding.
    The common case (a JPEG ending in EOI) costs three small ops."""

    def jpeg():
        n = tf.strings.length(image_bytes)
        last = tf.strings.substr(image_bytes, tf.maximum(n - 2, 0), tf.minimum(n, 2))
        return tf.cond(
            tf.equal(last, b"\xff\xd9"), lambda: tf.constant(True), lambda: _tail_contains(image_bytes, b"\xff\xd9")
        )

    def other():
        n = tf.strings.length(image_bytes)
        head = tf.strings.join([tf.strings.substr(image_bytes, 0, tf.minimum(n, 12)), "\0" * 12])

        def starts(signature: bytes, pos: int = 0):
            return tf.equal(tf.strings.substr(head, pos, len(signature)), signature)

        png = tf.logical_and(starts(b"\x89PNG\r\n\x1a\n"), _tail_contains(image_bytes, b"IEND"))
        webp = tf.logical_and(starts(b"RIFF"), starts(b"WEBP", 8))
        return tf.reduce_any(tf.stack([png, starts(b"GIF8"), starts(b"BM"), webp]))

    return tf.cond(tf.io.is_jpeg(image_bytes), jpeg, other)


class Transform:
    """Per-example decode + augmentation, for one policy. Images come out float32 in
    [0, 255]; `normalise` runs on whole batches (one vectorised op instead of three per
    image)."""

    def __init__(self, *, image_size, channels, augment, eval_crop_fraction, mean, std, num_classes, one_hot,
                 crop_padding=None, train_size=None):
        self.size = image_size
        self.channels = channels
        self.augment = augment
        self.eval_crop = eval_crop_fraction
        self.padding_given = crop_padding is not None
        self.crop_padding = max(1, int(round(image_size / 8))) if crop_padding is None else crop_padding
        # Progressive resizing (`trainwell.data.resizing`): a scalar int32 variable holding the side of
        # the training images, read as each one is made; evaluation images stay at `image_size`.
        self.train_size = train_size
        self.mean, self.std = tuple(mean), tuple(std)
        # Tiled to the full image: broadcasting a 3-vector over the channel axis runs a
        # scalar loop in Eigen; broadcasting an [S, S, C] image over the batch axis is
        # vectorised (0.15 vs 0.55 ms of CPU per 224-px image here).
        tile = [image_size, image_size, 1]
        self.offset = tf.tile(tf.constant([[[255.0 * m for m in mean]]], tf.float32), tile)
        self.scale = tf.tile(tf.constant([[[1.0 / (255.0 * d) for d in std]]], tf.float32), tile)
        self.num_classes = num_classes
        self.one_hot = one_hot

    def normalise(self, images, labels):
        if self.train_size is not None and images.shape[1] != self.size:  # training batches of another side
            tile = tf.stack([tf.shape(images)[1], tf.shape(images)[2], 1])
            offset = tf.tile(tf.constant([[[255.0 * m for m in self.mean]]], tf.float32), tile)
            scale = tf.tile(tf.constant([[[1.0 / (255.0 * d) for d in self.std]]], tf.float32), tile)
            return (images - offset) * scale, labels
        return (images - self.offset) * self.scale, labels

    def label(self, label):
        label = tf.cast(label, tf.int32)
        return tf.one_hot(label, self.num_classes, dtype=tf.float32) if self.one_hot else label

    def label_ok(self, label):
        return tf.logical_and(label >= 0, label < self.num_classes)

    def _side(self, train: bool):
        """The side of a training (`train`) or evaluation image: an int, or the progressive-resizing variable."""
        return tf.convert_to_tensor(self.train_size) if train and self.train_size is not None else self.size

    def _resize(self, image, side=None):
        side = self.size if side is None else side
        image = tf.image.resize(image, tf.stack([side, side]) if tf.is_tensor(side) else [side, side],
                                method="bilinear")
        image.set_shape([None if tf.is_tensor(side) else side] * 2 + [self.channels])
        return image

    def _decode(self, payload, window, encoded):
        return decode_window(payload, self.channels, window) if encoded else crop_array(payload, window)

    def train_image(self, payload, seed, *, encoded: bool):
        crop_seed, flip_seed, pad_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 3))
        side = self._side(train=True)
        if self.augment == "inception":
            image = self._resize(self._decode(payload, inception_window(crop_seed), encoded), side)
            return tf.image.stateless_random_flip_left_right(image, flip_seed)
        window = center_window(1.0 if self.augment != "none" else self.eval_crop)
        image = self._resize(self._decode(payload, window, encoded), side)
        if self.augment in ("pad_crop", "pad_crop_flip"):
            pad = self.crop_padding
            if tf.is_tensor(side) and not self.padding_given:  # side / 8 of the epoch's side, as at a fixed size
                pad = tf.maximum(1, tf.cast(tf.round(tf.cast(side, tf.float32) / 8.0), tf.int32))
            image = tf.pad(image, tf.stack([[pad, pad], [pad, pad], [0, 0]]) if tf.is_tensor(pad) else
                           [[pad, pad], [pad, pad], [0, 0]])
            image = tf.image.stateless_random_crop(image, tf.stack([side, side, self.channels]) if tf.is_tensor(side)
                                                   else [side, side, self.channels], pad_seed)
            if self.augment == "pad_crop_flip":
                image = tf.image.stateless_random_flip_left_right(image, flip_seed)
        return image

    def eval_image(self, payload, *, encoded: bool):
        return self._resize(self._decode(payload, center_window(self.eval_crop), encoded))

    def placeholder(self, train: bool = True):
        """A zero image of a training (`train`) or evaluation image's side: it stands in for a bad
        record until that is filtered out."""
        side = self._side(train)
        if tf.is_tensor(side):
            return tf.zeros(tf.stack([side, side, self.channels]), tf.float32)
        return tf.zeros([side, side, self.channels], tf.float32)
