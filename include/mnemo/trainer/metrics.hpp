#pragma once
// metrics_log: a training run's figures as JSON lines, one object per logged step and per validation,
// each line flushed as it is written (a crash loses nothing written before it). Keys, in this order:
//   {"run":"compressive","kind":"train","step":500,"tokens":128000,"loss":1.2345,"bits_per_char":1.781,
//    "ar":0.0123,"lr":0.001,"grad_norm":0.52,"tokens_per_s":23456,"elapsed_s":12.3}
//   {"run":"compressive","kind":"valid","step":1000,"tokens":256000,"loss":1.1,"bits_per_char":1.59,
//    "ar":0.0101,"accuracy":0.998,"segments":128,"elapsed_s":30.2}
// run: a label naming the run (several runs may share one file; tools/plot.sh draws one curve each);
// loss: mean cross-entropy in nats; bits_per_char = loss / ln 2; ar: the reconstruction loss (0 when
// nothing was compressed); tokens: tokens trained on so far (step · batch · seq_len); accuracy: the
// recall task's only; elapsed_s: seconds since this process started training.
//
// Opening: a fresh run truncates the file; a resumed run (resume_step >= 0) keeps the lines of steps up
// to resume_step and drops later ones (written by a run that went on past the checkpoint), so that
// appending never duplicates a step. The rewrite goes through a temporary file and a rename.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>

#include "../core/error.hpp"

namespace mnemo {

class metrics_log {
public:
    metrics_log() = default;
    /// Opens `path` (see the header comment); an empty path makes a log that writes nothing.
    explicit metrics_log(std::string path, std::int64_t resume_step = -1) : path_(std::move(path)) {
        if (path_.empty()) return;
        std::string kept;
        if (resume_step >= 0) {
            std::ifstream in(path_, std::ios::binary);
            std::string line;
            while (in && std::getline(in, line))
                if (!line.empty() && step_of(line) <= resume_step) kept += line + '\n';
        }
        const std::string tmp = path_ + ".tmp";
        {
            std::FILE* f = std::fopen(tmp.c_str(), "wb");
            MNEMO_CHECK(f, "metrics: cannot write '", tmp, "'");
            const bool ok = std::fwrite(kept.data(), 1, kept.size(), f) == kept.size();
            MNEMO_CHECK(std::fclose(f) == 0 && ok, "metrics: cannot write '", tmp, "'");
        }
        MNEMO_CHECK(std::rename(tmp.c_str(), path_.c_str()) == 0, "metrics: cannot replace '", path_, "'");
        file_.reset(std::fopen(path_.c_str(), "ab"));
        MNEMO_CHECK(file_, "metrics: cannot append to '", path_, "'");
    }

    explicit operator bool() const { return bool(file_); }
    const std::string& path() const { return path_; }

    void train(std::string_view run, std::int64_t step, std::int64_t tokens, double loss, double ar, double lr,
               double grad_norm, double tokens_per_s, double elapsed_s) {
        if (!file_) return;
        std::fprintf(file_.get(),
                     "{\"run\":\"%s\",\"kind\":\"train\",\"step\":%lld,\"tokens\":%lld,\"loss\":%s,\"bits_per_char\":%s,"
                     "\"ar\":%s,\"lr\":%s,\"grad_norm\":%s,\"tokens_per_s\":%s,\"elapsed_s\":%s}\n",
                     escaped(run).c_str(), (long long)step, (long long)tokens, num(loss).c_str(),
                     num(loss / ln2).c_str(), num(ar).c_str(), num(lr).c_str(), num(grad_norm).c_str(),
                     num(tokens_per_s).c_str(), num(elapsed_s).c_str());
        flush();
    }
    /// accuracy < 0: not a recall run (the key is left out).
    void valid(std::string_view run, std::int64_t step, std::int64_t tokens, double loss, double ar, double accuracy,
               std::int64_t segments, double elapsed_s) {
        if (!file_) return;
        std::string acc = accuracy >= 0 ? ",\"accuracy\":" + num(accuracy) : std::string();
        std::fprintf(file_.get(),
                     "{\"run\":\"%s\",\"kind\":\"valid\",\"step\":%lld,\"tokens\":%lld,\"loss\":%s,\"bits_per_char\":%s,"
                     "\"ar\":%s%s,\"segments\":%lld,\"elapsed_s\":%s}\n",
                     escaped(run).c_str(), (long long)step, (long long)tokens, num(loss).c_str(),
                     num(loss / ln2).c_str(), num(ar).c_str(), acc.c_str(), (long long)segments,
                     num(elapsed_s).c_str());
        flush();
    }

    /// The "step" of a metrics line (-1 when it has none).
    static std::int64_t step_of(std::string_view line) {
        const auto at = line.find("\"step\":");
        if (at == std::string_view::npos) return -1;
        return std::strtoll(std::string(line.substr(at + 7, 24)).c_str(), nullptr, 10);
    }

private:
    static constexpr double ln2 = 0.69314718055994530942;
    struct closer {
        void operator()(std::FILE* f) const { std::fclose(f); }
    };

    static std::string num(double x) {
        if (!std::isfinite(x)) return "null";  // JSON has no NaN or infinity
        char b[32];
        std::snprintf(b, sizeof b, "%.7g", x);
        return b;
    }
    static std::string escaped(std::string_view s) {
        std::string out;
        for (char c : s) {
            if (c == '"' || c == '\\') out += '\\';
            if (static_cast<unsigned char>(c) >= 0x20) out += c;
        }
        return out;
    }
    void flush() {
        MNEMO_CHECK(std::fflush(file_.get()) == 0, "metrics: cannot write '", path_, "' (is the disk full?)");
    }

    std::string path_;
    std::unique_ptr<std::FILE, closer> file_;
};

}  // namespace mnemo
