#include "core/model/step_io.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/base/host_convert.h"
#include "core/model/moe.h"

namespace moetrain {

namespace {

// `bytes` (a U8 buffer) read as a tensor of `dtype` and `shape` from byte `offset` on.
TensorView bytes_as(const TensorView& bytes, size_t offset, DType dtype, Shape shape) {
  return TensorView{static_cast<char*>(bytes.data) + offset, dtype, bytes.device, shape};
}

}  // namespace

void check_batch(const Batch& batch, int64_t vocab, int64_t max_position) {
  const int64_t n = batch.num_tokens();
  MOETRAIN_CHECK(static_cast<int64_t>(batch.input_ids.size()) == n && static_cast<int64_t>(batch.labels.size()) == n &&
                     static_cast<int64_t>(batch.positions.size()) == n && batch.cu_seqlens.size() >= 2 &&
                     batch.cu_seqlens.back() == n,
                 ExitCode::kInternal, fmt::format("malformed batch: input_ids, labels and positions must each hold its {} tokens, and "
                             "cu_seqlens end there",
                             n));
  for (int64_t t = 0; t < n; ++t) {
    MOETRAIN_CHECK(batch.input_ids[t] >= 0 && batch.input_ids[t] < vocab, ExitCode::kBadData,
                   fmt::format("token id {} at batch position {} is outside the vocabulary [0, {}): the data "
                               "was tokenized for another model",
                               batch.input_ids[t], t, vocab));
    MOETRAIN_CHECK(batch.labels[t] < vocab, ExitCode::kBadData,
                   fmt::format("label {} at batch position {} is outside the vocabulary [0, {})", batch.labels[t], t,
                               vocab));
    MOETRAIN_CHECK(batch.positions[t] >= 0 && batch.positions[t] < max_position, ExitCode::kBadData,
                   fmt::format("position {} at batch position {} exceeds model.max_position_embeddings ({}): "
                               "shorten data.seq_len or raise max_position_embeddings",
                               batch.positions[t], t, max_position));
  }
}

BatchTensors BatchStaging::upload(const Batch& batch) {
  const int64_t n = batch.num_tokens();
  Buffer& buffer = buffers_[turn_++ % buffers_.size()];
  if (buffer.copied) buffer.copied->wait();  // its last batch has left it
  const int64_t needed = 3 * n + static_cast<int64_t>(batch.cu_seqlens.size());
  if (!buffer.host.defined() || buffer.host.numel() < needed) {
    // Room for the most segments a batch of n tokens can have (n + 1 offsets): batches of one size
    // never make it grow, and a pinned allocation or free costs a wait of its own.
    buffer.host.reset();
    buffer.host = Tensor({std::max<int64_t>(needed, 4 * n + 1)}, DType::kI32, backend_.pinned_allocator());
  }
  int64_t used = 0;
  auto upload_values = [&](const std::vector<int32_t>& values) {
    const int64_t count = static_cast<int64_t>(values.size());
    std::copy(values.begin(), values.end(), buffer.host.ptr<int32_t>() + used);
    Tensor device({count}, DType::kI32, backend_.allocator());
    backend_.copy_async(device, buffer.host.view().slice_rows(used, used + count));
    used += count;
    return device;
  };
  BatchTensors bt;
  bt.input_ids = upload_values(batch.input_ids);
  bt.labels = upload_values(batch.labels);
  bt.positions = upload_values(batch.positions);
  bt.cu_seqlens = upload_values(batch.cu_seqlens);
  bt.host_cu_seqlens = batch.cu_seqlens;
  buffer.copied = backend_.record_event();
  bt.num_tokens = n;
  bt.micro_batch_rows = {0, n};
  bt.seq_len = batch.seq_len;
  bt.context = batch.context;
  return bt;
}

PendingStep ResultReadback::queue(const LayerContext& ctx, const Tensor& losses, const std::vector<MoeFfn*>& moe_layers,
                                  int64_t targets) {
  kernels::Backend& be = backend_;
  // One buffer: the losses, then per MoE layer its offsets (one set per token chunk) and (when it
  // has one) its aux loss, each part 8-byte aligned, so that the host's reads of it are aligned.
  struct Part {
    TensorView device;
    size_t offset;
  };
  std::vector<Part> parts;
  size_t bytes = 0;
  auto add = [&](const TensorView& device) {
    parts.push_back({device, bytes});
    bytes += (device.nbytes() + 7) / 8 * 8;
  };
  add(losses);
  struct Routed {
    size_t offsets, chunks, aux;  // parts' indices: the first chunk's offsets, its count (aux: 0
                                  // when the layer has no aux loss)
    int64_t experts;
  };
  std::vector<Routed> routed;
  for (MoeFfn* moe : moe_layers) {
    const std::vector<Tensor>& offsets = moe->stats_offsets();
    MOETRAIN_ASSERT(!offsets.empty(), "an MoE layer without statistics after its forward");
    Routed r{parts.size(), offsets.size(), 0, offsets.front().numel() - 1};
    for (const Tensor& chunk : offsets) add(chunk);
    if (moe->stats_aux_loss().defined()) {
      r.aux = parts.size();
      add(moe->stats_aux_loss());
    }
    routed.push_back(r);
  }
  Tensor gathered = ctx.alloc({static_cast<int64_t>(bytes)}, DType::kU8);
  for (const Part& part : parts) {
    be.copy(bytes_as(gathered, part.offset, part.device.dtype, part.device.shape), part.device);
  }

  std::shared_ptr<Tensor> host;  // a free pinned buffer, or a new one
  for (const std::shared_ptr<Tensor>& buffer : buffers_) {
    if (buffer.use_count() == 1 && buffer->nbytes() >= bytes) {
      host = buffer;
      break;
    }
  }
  if (!host) {
    host = std::make_shared<Tensor>(Shape{static_cast<int64_t>(bytes)}, DType::kU8, be.pinned_allocator());
    buffers_.push_back(host);
  }
  // A buffer a dropped PendingStep left may still be being written: this copy is queued after that.
  be.copy_async(host->view().slice_rows(0, static_cast<int64_t>(bytes)), gathered);
  std::shared_ptr<kernels::QueueEvent> arrived = be.record_event();
  const std::vector<int64_t> bounds = ctx.batch.micro_batch_rows;
  return PendingStep([host, arrived, parts, routed, targets, bounds]() {
    arrived->wait();
    auto part = [&](size_t i) {
      return bytes_as(host->view(), parts[i].offset, parts[i].device.dtype, parts[i].device.shape);
    };
    // The sum of the per-token losses in token order, in double, micro-batch by micro-batch.
    Tensor values(parts[0].device.shape, DType::kF64);
    convert_host(values, part(0));
    StepResult result;
    result.targets = targets;
    for (size_t j = 0; j + 1 < bounds.size(); ++j) {
      double sum = 0.0;
      for (int64_t i = bounds[j]; i < bounds[j + 1]; ++i) sum += values.ptr<double>()[i];
      result.micro_batch_loss_sums.push_back(sum);
      result.loss_sum += sum;
    }
    for (const Routed& r : routed) {
      std::vector<int64_t> counts(static_cast<size_t>(r.experts), 0);
      for (size_t c = 0; c < r.chunks; ++c) {
        const int32_t* o = part(r.offsets + c).ptr<int32_t>();
        for (int64_t i = 0; i < r.experts; ++i) counts[static_cast<size_t>(i)] += o[i + 1] - o[i];
      }
      FeedForwardStats stats = MoeFfn::expert_loads(counts);
      result.expert_gemm_calls = static_cast<int64_t>(r.chunks);
      result.expert_rows.push_back(std::move(counts));
      if (r.aux != 0) {
        Tensor aux({1}, DType::kF64);
        convert_host(aux, part(r.aux));
        stats.aux_loss = aux.ptr<double>()[0];
      }
      result.max_expert_load = std::max(result.max_expert_load, stats.max_expert_load);
      result.aux_loss += stats.aux_loss;
      result.expert_load_max.push_back(stats.max_expert_load);
      result.expert_load_min.push_back(stats.min_expert_load);
    }
    return result;
  });
}

}  // namespace moetrain
